#!/usr/bin/env bash
# Speculative decoding on a GPU machine with PyTorch, in one call: `pip install
# --no-build-isolation .` (CUDA backend, sm_90, scripts/device_install.sh), the CUDA tests of
# test_speculative.py and test_engine_spec.py (the engine's speculative steps), then `python -m
# replayssm.bench_spec` (both real layouts, batches 16/64/256, T = 4: replay verify,
# per-draft-state verify and plain decoding under CUDA graphs).
# Outputs under $OUT: summary.txt, pytest.log, bench_spec.json, bench_spec.txt, logs.tar.gz
# (pip and bench stderr); a short summary on stdout.
#   run: command "scripts/device_spec.sh", carry [".deps"] (nlohmann/ headers: the GPU machine
#   has no apt).
# Expected runtime on an H200: about 7 minutes (install ~2, tests ~2, benchmark ~3). Phases can
# run in separate calls on the same warm machine: scripts/device_spec.sh install test, then
# scripts/device_spec.sh bench (BENCH_ARGS replaces the benchmark's arguments).
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
source "$(dirname "$0")/device_lib.sh"
device_setup spec "$@"
device_test 300 "test_speculative.py test_engine_spec.py" python/tests/test_speculative.py \
  python/tests/test_engine_spec.py
device_bench " 256 |^target"
