#!/usr/bin/env bash
# The GDN CUDA kernels on a machine with an NVIDIA GPU, in one run: build the library, the GDN
# CUDA tests and the CUDA benchmark sweep for the GDN shapes, run them, and leave logs and JSON
# under $OUT (default: ./out). Needs what scripts/device_check.sh lists (CUDA toolkit, cmake,
# g++, CLI11 and nlohmann-json from Debian or copied into .deps/include).
#   Run from the repository root:  scripts/device_gdn.sh
# Optional: GDN_BENCH_ARGS (e.g. "--batches 256 --L 16") narrows the sweep; GDN_SKIP_TESTS=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
jobs=$(nproc)
log() { echo "[device_gdn $(date +%T)] $*" | tee -a "$OUT/info.txt"; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv >>"$OUT/info.txt" 2>&1
log "$(cmake --version | head -1); $(nvcc --version | tail -1)"

configure() {
  cmake -S . -B build-dev -DCMAKE_BUILD_TYPE=Release -DREPLAYSSM_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90-real -DREPLAYSSM_THIRD_PARTY_INCLUDE="$PWD/.deps/include" \
    >>"$OUT/build.log" 2>&1
}
configure || { log "configure failed"; tail -20 "$OUT/build.log"; exit 1; }
log "building"
cmake --build build-dev -j"$jobs" --target test_gdn_cuda replayssm_cuda_bench >>"$OUT/build.log" 2>&1 \
  || { log "build failed"; grep -E "error" "$OUT/build.log" | head -30; exit 1; }
grep -E "ptxas.*(gdn_|spill)" "$OUT/build.log" | head -20 >>"$OUT/info.txt"
log "built"

if [ "${GDN_SKIP_TESTS:-0}" != 1 ]; then
  # The test binary directly: one CUDA context for all cases (ctest would start one process,
  # and one context, per case).
  timeout 120 build-dev/tests/test_gdn_cuda >"$OUT/tests.log" 2>&1
  log "tests rc=$? :: $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/tests.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED  \]|Failure|Expected|Which is|actual|curve" "$OUT/tests.log" | head -60
fi

log "bench"
./build-dev/bench/replayssm_cuda_bench --shapes qwen35-4b,qwen35-122b ${GDN_BENCH_ARGS:-} \
  --json "$OUT/gdn_bench.json" >"$OUT/bench.log" 2>&1
log "bench rc=$?"
cat "$OUT/bench.log"
