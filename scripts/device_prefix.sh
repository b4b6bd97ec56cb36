#!/usr/bin/env bash
# Prefix caching with whole models on a GPU machine with PyTorch, in one call: `pip install
# --no-build-isolation .` (CUDA backend, sm_90), the CUDA tests of test_prefix_cache.py (the
# engine with and without a prefix cache on CUDA, graphs on; host entries for a device cache)
# and of the model files (every prefill ends with the SSM hand-off the prefix work changed),
# then `python -m replayssm.bench_prefix` (both real layouts, bf16, replay-fp32+bf16, a
# 2048-token prompt, blocks of 64: whole prefill vs a hit). Outputs under $OUT: summary.txt,
# pytest.log, bench_prefix.json, bench_prefix.txt, logs.tar.gz; a short summary on stdout.
#   run: command "scripts/device_prefix.sh", carry [".deps"] (as device_e2e.sh).
# Expected runtime on an H200: about 6 minutes (install ~2, tests ~3, benchmark ~1).
set -uo pipefail
# shellcheck source=scripts/device_lib.sh
source "$(dirname "$0")/device_lib.sh"
device_setup prefix "$@"
device_test 360 "" python/tests/test_prefix_cache.py python/tests/test_models_*.py \
  python/tests/test_engine_e2e.py
device_bench "prefill"
