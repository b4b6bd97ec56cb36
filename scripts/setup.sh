#!/usr/bin/env bash
# Installs what the build needs (Debian packages) and builds replayssm into build/.
# CUDA is built when nvcc is found (PATH or /usr/local/cuda); tests needing a GPU skip without one.
# REPLAYSSM_ENABLE_CUDA=OFF builds CPU-only even where nvcc is installed (the CUDA kernels are
# most of the build time); the choice stays in build/ until it is given again.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake g++ make libgtest-dev libcli11-dev nlohmann-json3-dev python3)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

jobs=$(nproc)
cuda_option=()
if [ -n "${REPLAYSSM_ENABLE_CUDA:-}" ]; then
  cuda_option=(-DREPLAYSSM_ENABLE_CUDA="$REPLAYSSM_ENABLE_CUDA")
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${cuda_option[@]}" >/dev/null
cmake --build build -j"$jobs"
