#!/usr/bin/env bash
# Set up and build (as scripts/setup.sh), then run the whole test suite. Tests labelled `cuda`
# skip themselves where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ctest --test-dir build --output-on-failure -j"$(nproc)" "$@"
# The Python package: `pip install .` into a fresh virtual environment, then its pytest suite.
scripts/test_python.sh
