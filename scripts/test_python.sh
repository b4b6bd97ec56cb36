#!/usr/bin/env bash
# The Python package's tests: `pip install .` into a fresh virtual environment (build-python/venv),
# then pytest (python/tests). PyTorch and transformers are installed into that environment
# (from PyPI, about 3 GB with PyTorch's CUDA libraries) so that the torch tests and the
# end-to-end model tests (ours against transformers' models, on tiny configs) run on the CPU;
# REPLAYSSM_PYTHON_TORCH=OFF skips them, as does a failed install (with a warning). Without a
# GPU the CUDA tests skip.
#   REPLAYSSM_PYTHON_CUDA=OFF (the default here) builds the package CPU-only: the C++ build has
#   already compiled the CUDA backend, and no test can run it without a GPU. =ON builds the
#   CUDA backend when nvcc is found, as a plain `pip install .` does.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build-python/venv
python=${PYTHON:-python3}

if ! "$python" -m venv --clear "$venv" >/dev/null 2>&1; then
  echo "test_python: installing python3-venv and python3-dev"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq python3-venv python3-dev >/dev/null
  python=/usr/bin/python3
  "$python" -m venv --clear "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q pytest
if [ "${REPLAYSSM_PYTHON_TORCH:-ON}" = ON ]; then
  start=$(date +%s)
  if "$venv/bin/python" -m pip install -q "torch==2.11.*" "transformers==5.17.*" safetensors; then
    echo "test_python: torch and transformers installed in $(( $(date +%s) - start )) s"
  else
    echo "test_python: WARNING: could not install torch/transformers; their tests will skip" >&2
  fi
fi
cuda=${REPLAYSSM_PYTHON_CUDA:-OFF}
define=()
[ "$cuda" = ON ] || define=(-C cmake.define.REPLAYSSM_ENABLE_CUDA=OFF)
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  "$venv/bin/python" -m pip install -q "${define[@]}" .
# From outside the source tree, so that `import replayssm` finds the installed package.
(cd build-python && "$OLDPWD/$venv/bin/python" -m pytest -q "$OLDPWD/python/tests" "$@")
"$venv/bin/python" examples/python_decode.py
