#!/usr/bin/env bash
# The end-to-end model path on a GPU machine with PyTorch, in one call: `pip install
# --no-build-isolation .` (CUDA backend, sm_90), the CUDA tests of the model files
# (test_models_*.py, the fused decode kernels' test_models_fused.py included), the routed
# experts' (test_moe.py), attention and engine test files, then `python -m replayssm.bench_e2e` (both real layouts, every state mode,
# batches 1/16/64/256, synchronized and staggered starts). Outputs under $OUT: summary.txt,
# pytest.log, bench_e2e.json, bench_e2e.txt, logs.tar.gz (pip and bench stderr); a short
# summary on stdout. Plot here afterwards: python -m replayssm.bench_e2e --plot bench_e2e.json
#   run: command "scripts/device_e2e.sh", carry [".deps"] (nlohmann/ headers: the GPU machine
#   has no apt).
# Expected runtime on an H200: about 7 minutes (install ~2, tests ~2, benchmark ~3). Phases
# can run in separate calls on the same warm machine: scripts/device_e2e.sh install test, then
# scripts/device_e2e.sh bench (BENCH_ARGS replaces the benchmark's arguments; e.g. the
# mixture-of-experts layouts: BENCH_ARGS="--layouts nemotron-nano-30b-a3b qwen3.5-35b-a3b").
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
source "$(dirname "$0")/device_lib.sh"
device_setup e2e "$@"
device_test 240 "" python/tests/test_models_*.py python/tests/test_moe.py \
  python/tests/test_attention.py python/tests/test_engine_e2e.py
device_bench "staggered +256|^target"
