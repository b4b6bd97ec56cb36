#!/usr/bin/env bash
# Installs the package on a GPU machine with PyTorch and no network: `pip install
# --no-build-isolation .` with the CUDA backend for sm_90, built in /tmp/replayssm-build (a
# second call on the same machine rebuilds only what changed). Needs nlohmann/ headers under
# .deps/include (carried) or REPLAYSSM_THIRD_PARTY_INCLUDE.
#   usage: scripts/device_install.sh LOG   (pip's output goes to LOG; prints one line, and
#   pip's errors when it fails; exits with pip's status)
set -uo pipefail
log=$1
cd "$(dirname "$0")/.." || exit
export PATH=/usr/local/cuda/bin:$PATH
export REPLAYSSM_THIRD_PARTY_INCLUDE=${REPLAYSSM_THIRD_PARTY_INCLUDE:-$PWD/.deps/include}
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v . \
  -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90-real -C build-dir=/tmp/replayssm-build \
  >"$log" 2>&1
rc=$?
echo "pip install --no-build-isolation: rc=$rc in $(( $(date +%s) - start )) s"
[ $rc = 0 ] || grep -E "error|Error" "$log" | head -30
exit $rc
