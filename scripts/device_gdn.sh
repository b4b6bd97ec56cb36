#!/usr/bin/env bash
# Issue 4 (GDN CUDA kernels) on the GPU machine, in one call: build the library, the GDN CUDA
# tests and the GDN benchmark, run them, and leave logs and JSON under $OUT (at most 8 files
# come back, so the JSON travels as one tar).
#   run: command "scripts/device_gdn.sh", carry [".deps"] (nlohmann/ and CLI/ headers).
# Optional: GDN_BENCH_ARGS=--quick skips the batch and L sweeps; GDN_SKIP_TESTS=1.
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
if ! configure; then
  # CMake releases that do not know nvcc 13's C++20 flag: on this copy only, ask for CUDA 17
  # and make the "17" flag say c++20.
  log "configure failed; retrying with the CUDA-standard workaround"
  sed -i 's/set(CMAKE_CUDA_STANDARD 20)/set(CMAKE_CUDA_STANDARD 17)\n  set(CMAKE_CUDA17_STANDARD_COMPILE_OPTION "-std=c++20")\n  set(CMAKE_CUDA17_EXTENSION_COMPILE_OPTION "-std=c++20")/' CMakeLists.txt
  rm -rf build-dev
  configure || { log "configure failed"; exit 1; }
fi
log "building"
cmake --build build-dev -j"$jobs" --target test_gdn_cuda replayssm_bench >>"$OUT/build.log" 2>&1 \
  || { log "build failed"; grep -E "error" "$OUT/build.log" | head -30; exit 1; }
nvcc -std=c++20 -O3 -gencode arch=compute_90,code=sm_90 -DREPLAYSSM_WITH_CUDA=1 \
  -DREPLAYSSM_GDN_BENCH_MAIN -Iinclude -Isrc -Ibench bench/cuda_bench_gdn.cu \
  build-dev/bench/libreplayssm_bench.a build-dev/src/libreplayssm.a -Xcompiler -fopenmp -lgomp \
  -o build-dev/gdn_bench >>"$OUT/build.log" 2>&1 || { log "bench build failed"; exit 1; }
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
./build-dev/gdn_bench "$OUT" ${GDN_BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
log "bench rc=$?"
(cd "$OUT" && tar cf json.tar gdn_*.json && rm -f gdn_*.json) 2>/dev/null
cat "$OUT/bench.log"
