#!/usr/bin/env bash
# The main job: set up and build (scripts/setup.sh), then `replayssm demo`: replay decoding
# against eager decoding at real layer shapes on generated inputs, how far apart their outputs
# are, and their speed on this machine with the state streaming from memory (and, where replay
# does not pay here, why), on the GPU when one is present, else on the CPU.
# Arguments go to the demo (`build/tools/replayssm demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build/tools/replayssm demo "$@"
