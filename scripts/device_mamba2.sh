#!/usr/bin/env bash
# The Mamba-2 CUDA kernels on a machine with an NVIDIA GPU: build the CUDA test and bench
# targets, run the CUDA tests, then the benchmark. Logs and JSON go to $OUT (default: ./out).
#   scripts/device_mamba2.sh [test|bench|all] [bench args...]   (from the repository root)
# Needs what scripts/device_check.sh lists (CUDA toolkit, cmake, g++, CLI11 and nlohmann-json
# from Debian or copied into .deps/include).
set -uo pipefail
what=${1:-all}
shift || true
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw \
  --format=csv 2>&1 | tee "$OUT/gpu.txt"
cmake --version | head -1
cmake -S . -B build-dev -DREPLAYSSM_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
  -DREPLAYSSM_THIRD_PARTY_INCLUDE="$PWD/.deps/include" \
  >"$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; exit 1; }
start=$(date +%s)
cmake --build build-dev -j16 --target test_mamba2_cuda replayssm_cuda_bench >"$OUT/build.log" 2>&1 ||
  { grep -E "error" -A3 "$OUT/build.log" | head -60; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
status=0
if [[ $what == test || $what == all ]]; then
  start=$(date +%s)
  ./build-dev/tests/test_mamba2_cuda --gtest_brief=1 >"$OUT/test.log" 2>&1 || status=1
  echo "tests: $(( $(date +%s) - start )) s, exit $status"
  grep -E "FAILED|Failure|error|PASSED|tests ran" "$OUT/test.log" | head -40
fi
if [[ $what == bench || $what == all ]]; then
  start=$(date +%s)
  ./build-dev/bench/replayssm_cuda_bench --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.txt"
  echo "bench: $(( $(date +%s) - start )) s"
fi
exit $status
