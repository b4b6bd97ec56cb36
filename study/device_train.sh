#!/usr/bin/env bash
# Trains the accuracy study's two models on the GPU machine, about 2.5 minutes of training each
# (about 6 minutes in all with start-up and evaluations).
#
# Writes to $OUT (at most 8 files, each under 16 MB):
#   nemotron_h.safetensors, qwen3_5.safetensors   the weights (bf16), one file per model
#   study_train.tar    per model: config.json, generation_config.json, heldout.txt, curve.json,
#                      and the training log <family>.log
# Prints one SUMMARY line per model. Unpack with study/README.md's commands.
# TRAIN_ARGS adds flags to train.py (TRAIN_ARGS=--smoke checks this script on a CPU).
set -uo pipefail
: "${OUT:?set OUT to the output directory}"
python=${PYTHON:-python3}
budget=${TIME_BUDGET_S:-150}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
status=0
"$python" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
for family in nemotron_h qwen3_5; do
  if "$python" "$here/train.py" --family "$family" --out "$work/$family" \
      --time-budget-s "$budget" ${TRAIN_ARGS:-} >"$work/$family.log" 2>&1; then
    grep '^SUMMARY' "$work/$family.log"
    cp "$work/$family/model.safetensors" "$OUT/$family.safetensors"
  else
    status=1
    echo "FAILED $family; the log's tail:"
    tail -n 25 "$work/$family.log"
  fi
done
tar -C "$work" --exclude=model.safetensors -cf "$OUT/study_train.tar" .
exit $status
