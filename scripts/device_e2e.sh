#!/usr/bin/env bash
# The end-to-end model path on a GPU machine with PyTorch, in one call: `pip install
# --no-build-isolation .` (CUDA backend, sm_90), the CUDA tests of the model files
# (test_models_*.py, the fused decode kernels' test_models_fused.py included), attention and
# engine test files, then `python -m replayssm.bench_e2e` (both real layouts, every state mode,
# batches 1/16/64/256, synchronized and staggered starts). Outputs under $OUT: summary.txt,
# pytest.log, bench_e2e.json, bench_e2e.txt, logs.tar.gz (pip and bench stderr); a short
# summary on stdout. Plot here afterwards: python -m replayssm.bench_e2e --plot bench_e2e.json
#   run: command "scripts/device_e2e.sh", carry [".deps"] (nlohmann/ headers: the GPU machine
#   has no apt).
# Expected runtime on an H200: about 7 minutes (install ~2, tests ~2, benchmark ~3). Phases
# can run in separate calls on the same warm machine: scripts/device_e2e.sh install test, then
# scripts/device_e2e.sh bench (BENCH_ARGS replaces the benchmark's arguments).
set -uo pipefail
cd "$(dirname "$0")/.." || exit
root=$PWD
OUT=${OUT:-$root/out}
mkdir -p "$OUT" "$OUT/logs"
export PYTHONUNBUFFERED=1
phases=${*:-install test bench}
log() { echo "[device_e2e $(date +%T)] $*" | tee -a "$OUT/summary.txt"; }
finish() { tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"; }
trap finish EXIT

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$OUT/summary.txt" 2>&1
if [[ " $phases " == *" install "* ]]; then
  msg=$(scripts/device_install.sh "$OUT/logs/pip.log")
  rc=$?
  log "$msg"
  [ $rc = 0 ] || exit 1
fi

cd /tmp || exit  # import the installed package, not the source tree
if [[ " $phases " == *" test "* ]]; then
  start=$(date +%s)
  tests=()
  for f in "$root"/python/tests/test_models_*.py "$root"/python/tests/test_attention.py \
           "$root"/python/tests/test_engine_e2e.py; do
    [ -e "$f" ] && tests+=("$f")
  done
  timeout 240 python3 -m pytest -v --tb=short -rs -p no:cacheprovider -m cuda \
    -o faulthandler_timeout=120 "${tests[@]}" >"$OUT/pytest.log" 2>&1
  log "pytest -m cuda: rc=$? in $(( $(date +%s) - start )) s: $(tail -1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20 | tee -a "$OUT/summary.txt"
fi

if [[ " $phases " == *" bench "* ]]; then
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout 330 python3 -m replayssm.bench_e2e ${BENCH_ARGS:-} --json "$OUT/bench_e2e.json" \
    >"$OUT/bench_e2e.txt" 2>"$OUT/logs/bench_e2e.stderr"
  log "bench_e2e: rc=$? in $(( $(date +%s) - start )) s"
  tail -3 "$OUT/logs/bench_e2e.stderr" >>"$OUT/summary.txt"
  grep -E "staggered +256|^target" "$OUT/bench_e2e.txt" | tee -a "$OUT/summary.txt"
fi
