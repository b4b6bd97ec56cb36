#!/usr/bin/env bash
# Everything the GPU needs checking, in one run on any machine with an NVIDIA GPU: build (sm_90
# machine code plus compute_80 PTX), the CUDA tests through ctest, `replayssm run --device cuda`
# on the golden traces against their float64 outputs, and the CUDA benchmarks (protocol cases,
# spec verify) with JSON and plots. Results and summary.txt go to $OUT (default: ./out).
#   Needs: the CUDA toolkit (nvcc on PATH or in /usr/local/cuda/bin), cmake >= 3.24, g++, and
#   the header-only libraries CLI11 and nlohmann-json: Debian's libcli11-dev and
#   nlohmann-json3-dev, or, on a machine without apt, their headers copied into
#   .deps/include/CLI/ and .deps/include/nlohmann/ (e.g. from another machine's /usr/include);
#   python3 with numpy and safetensors for the golden comparison, matplotlib for the plots.
#   Run from the repository root:  scripts/device_check.sh   (or OUT=/some/dir scripts/...)
#   DEVICE_CHECK_BENCH=0 skips the benchmarks; DEVICE_CHECK_BATCHES=64,256 narrows them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
log() { echo "[device_check $(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >>"$OUT/summary.txt" 2>&1
log "$(cmake --version | head -1); $(nvcc --version | tail -1)"
cmake -S . -B build-dev -DCMAKE_BUILD_TYPE=Release -DREPLAYSSM_ENABLE_CUDA=ON -DREPLAYSSM_CUDA_WARN_SPILLS=ON \
  -DCMAKE_CUDA_ARCHITECTURES="90-real;80-virtual" \
  -DREPLAYSSM_THIRD_PARTY_INCLUDE="$PWD/.deps/include" >/tmp/build.log 2>&1 ||
  { log "configure failed"; tail -20 /tmp/build.log; exit 1; }
cmake --build build-dev -j"$(nproc)" >>/tmp/build.log 2>&1 ||
  { log "build failed"; grep -E "error" /tmp/build.log | head -30; exit 1; }
log "built"

ctest --test-dir build-dev -L cuda -j8 --timeout 300 >"$OUT/ctest_cuda.log" 2>&1
log "ctest -L cuda: rc=$? $(grep -E 'tests passed|tests failed' "$OUT/ctest_cuda.log")"
grep -E "\*\*\*Failed|Not Run|Timeout" "$OUT/ctest_cuda.log" | head -20 | tee -a "$OUT/summary.txt"

# The tool itself on the golden traces, every mode, against the float64 expected files.
for trace in mamba2_small gdn_small; do
  for mode in "--mode eager" "--mode replay -L 1" "--mode replay -L 16" "-L 4 -T 4 --accept-seed 3" \
              "-L 4 --checkpoint fp32+bf16" "-L 4 --checkpoint fp32+fp8" "-L 4 --checkpoint bf16"; do
    build-dev/tools/replayssm run --device cuda --trace tests/data/$trace.safetensors \
      --out /tmp/out.safetensors $mode >/dev/null 2>>"$OUT/summary.txt" || { log "run failed: $trace $mode"; continue; }
    python3 - "$trace" "$mode" <<'PY' | tee -a "$OUT/summary.txt"
import sys
from safetensors.numpy import load_file
trace, mode = sys.argv[1], sys.argv[2]
got, ref = load_file("/tmp/out.safetensors"), load_file(f"tests/data/{trace}.expected.safetensors")
out = "y" if "y" in ref else "o"
def rel(a, b): return float(abs(a.astype("float64") - b).max() / abs(b).max())
print(f"golden {trace:13s} {mode:28s} out {rel(got[out], ref[out]):.2e}  state {rel(got['state'], ref['state']):.2e}")
PY
  done
done

if [ "${DEVICE_CHECK_BENCH:-1}" = 1 ]; then
  build-dev/tools/replayssm bench --device cuda --shape all --batch ${DEVICE_CHECK_BATCHES:-1,4,16,64,256,1024} \
    --checkpoint fp32,bf16,fp32+bf16,fp32+fp8 --json "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
  log "bench staggered rc=$?"
  build-dev/tools/replayssm bench --device cuda --shape all --batch 256 --flush aligned \
    --checkpoint fp32,bf16,fp32+bf16,fp32+fp8 --json "$OUT/bench_aligned.json" >>"$OUT/bench.txt" 2>&1
  log "bench aligned rc=$?"
  build-dev/tools/replayssm bench --device cuda --spec-tokens 4 --shape all --batch 256 \
    --checkpoint fp32,fp32+bf16 --json "$OUT/bench_spec.json" >>"$OUT/bench.txt" 2>&1
  log "bench spec rc=$?"
  (cd "$OUT" && python3 "$OLDPWD/bench/plot.py" bench.json && python3 "$OLDPWD/bench/plot.py" bench_spec.json) >>"$OUT/summary.txt" 2>&1
  ls "$OUT" >>"$OUT/summary.txt"
fi
cat "$OUT/summary.txt"
