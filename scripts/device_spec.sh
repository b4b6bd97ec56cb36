#!/usr/bin/env bash
# Speculative decoding on a GPU machine with PyTorch, in one call: `pip install
# --no-build-isolation .` (CUDA backend, sm_90, scripts/device_install.sh), the CUDA tests of
# test_speculative.py, then `python -m replayssm.bench_spec` (both real layouts, batches
# 16/64/256, T = 4: replay verify, per-draft-state verify and plain decoding under CUDA graphs).
# Outputs under $OUT: summary.txt, pytest.log, bench_spec.json, bench_spec.txt, logs.tar.gz
# (pip and bench stderr); a short summary on stdout.
#   run: command "scripts/device_spec.sh", carry [".deps"] (nlohmann/ headers: the GPU machine
#   has no apt).
# Expected runtime on an H200: about 6 minutes (install ~2, tests ~1, benchmark ~3). Phases can
# run in separate calls on the same warm machine: scripts/device_spec.sh install test, then
# scripts/device_spec.sh bench (BENCH_ARGS replaces the benchmark's arguments).
set -uo pipefail
cd "$(dirname "$0")/.." || exit
root=$PWD
OUT=${OUT:-$root/out}
mkdir -p "$OUT" "$OUT/logs"
export PYTHONUNBUFFERED=1
phases=${*:-install test bench}
log() { echo "[device_spec $(date +%T)] $*" | tee -a "$OUT/summary.txt"; }
finish() { tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"; }
trap finish EXIT

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  >>"$OUT/summary.txt" 2>&1
if [[ " $phases " == *" install "* ]]; then
  msg=$(scripts/device_install.sh "$OUT/logs/pip.log")
  rc=$?
  log "$msg"
  [ $rc = 0 ] || exit 1
fi

cd /tmp || exit  # import the installed package, not the source tree
if [[ " $phases " == *" test "* ]]; then
  start=$(date +%s)
  timeout 180 python3 -m pytest -v --tb=short -rs -p no:cacheprovider -m cuda \
    -o faulthandler_timeout=120 "$root/python/tests/test_speculative.py" >"$OUT/pytest.log" 2>&1
  rc=$?
  log "pytest -m cuda test_speculative.py: rc=$rc in $(( $(date +%s) - start )) s:" \
    "$(tail -1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20 | tee -a "$OUT/summary.txt"
fi

if [[ " $phases " == *" bench "* ]]; then
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout 330 python3 -m replayssm.bench_spec ${BENCH_ARGS:-} --json "$OUT/bench_spec.json" \
    >"$OUT/bench_spec.txt" 2>"$OUT/logs/bench_spec.stderr"
  log "bench_spec: rc=$? in $(( $(date +%s) - start )) s"
  tail -3 "$OUT/logs/bench_spec.stderr" >>"$OUT/summary.txt"
  grep -E " 256 |^target" "$OUT/bench_spec.txt" | tee -a "$OUT/summary.txt"
fi
