#!/usr/bin/env bash
# The main job: set up, build, and show replay decoding matching eager decoding and how much
# faster it is, on the GPU when one is present, else on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build/tools/replayssm demo "$@"
