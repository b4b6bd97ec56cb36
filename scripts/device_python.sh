#!/usr/bin/env bash
# The Python package on a GPU machine with PyTorch, in one call: `pip install
# --no-build-isolation .` (CUDA backend, sm_90), the whole pytest suite (CUDA and torch tests
# included), the example, and the host-overhead benchmark. Logs and JSON under $OUT.
#   run: command "scripts/device_python.sh", carry [".deps"] (nlohmann/ headers: the GPU machine
#   has no apt).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
OUT=${OUT:-$root/out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
export REPLAYSSM_THIRD_PARTY_INCLUDE=${REPLAYSSM_THIRD_PARTY_INCLUDE:-$root/.deps/include}
log() { echo "[device_python $(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$OUT/summary.txt" 2>&1
python3 - >>"$OUT/summary.txt" 2>&1 <<'PY'
import sys, torch, nanobind, scikit_build_core
print("python", sys.version.split()[0], "torch", torch.__version__, "nanobind", nanobind.__version__,
      "scikit-build-core", scikit_build_core.__version__, "exchange API",
      [a for a in ("__dlpack_c_exchange_api__", "__c_dlpack_exchange_api__") if hasattr(torch.Tensor, a)])
PY
msg=$(scripts/device_install.sh "$OUT/pip.log")
rc=$?
log "$msg"
[ $rc = 0 ] || exit 1

cd /tmp  # import the installed package, not the source tree
python3 -m replayssm.bench_overhead --json "$OUT/overhead.json" >"$OUT/overhead.txt" 2>&1
log "bench_overhead: rc=$?"
python3 "$root/examples/python_decode.py" >>"$OUT/summary.txt" 2>&1
log "example: rc=$?"
# The torch tests (CUDA and CPU) first, then the rest; each test at most 3 minutes.
start=$(date +%s)
timeout 420 python3 -m pytest -v --tb=short -rs -p no:cacheprovider -o faulthandler_timeout=180 \
  "$root/python/tests/test_torch.py" "$root/python/tests" ${PYTEST_ARGS:-} >"$OUT/pytest.log" 2>&1
log "pytest: rc=$? in $(( $(date +%s) - start )) s: $(tail -1 "$OUT/pytest.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30 | tee -a "$OUT/summary.txt"
cat "$OUT/overhead.txt"
