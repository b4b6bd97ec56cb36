#!/usr/bin/env bash
# Set up and build (as scripts/setup.sh), then run the whole test suite: one CTest test per
# test binary (a failing one is shown with its whole output), then one line that counts the
# test cases inside them. Tests labelled `cuda` skip themselves where no GPU is present; that
# line says how many cases skipped and why; then the Python package in a fresh virtual
# environment (scripts/test_python.sh). Extra arguments go to ctest (e.g. -L cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

results=build/test-results  # each test binary's cases, as gtest XML (tests/CMakeLists.txt)
rm -rf "$results"
status=0
# Without ctest's "Start N: <name>" lines, which the result lines repeat.
ctest --test-dir build --output-on-failure -j"$(nproc)" "$@" |
  grep -Ev '^ +Start +[0-9]+: ' || status=$?

if compgen -G "$results/*.xml" >/dev/null; then
  python3 - "$results" <<'PY'
import collections, glob, sys, xml.etree.ElementTree as ET

passed = failed = 0
skipped = collections.Counter()  # the skip message's last line -> cases
for path in glob.glob(sys.argv[1] + "/*.xml"):
    for case in ET.parse(path).iter("testcase"):
        skip = case.find("skipped")
        if case.find("failure") is not None:
            failed += 1
        elif skip is not None:
            lines = (skip.get("message") or "").strip().splitlines()
            skipped[lines[-1] if lines else "no reason given"] += 1
        else:
            passed += 1
line = f"Test cases: {passed} passed, {failed} failed, {sum(skipped.values())} skipped"
if skipped:
    line += " (" + ", ".join(f"{why}: {n}" for why, n in skipped.most_common()) + ")"
print(line)
PY
fi

# The Python package: `pip install .` into a fresh virtual environment, then its pytest suite.
scripts/test_python.sh || status=$?
exit "$status"
