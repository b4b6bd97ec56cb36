#!/usr/bin/env bash
# The accuracy study on the GPU machine (run from anywhere; needs the trained models unpacked
# into study/models/, see study/README.md). Carry [".deps"] for scripts/device_install.sh.
#
# 1. scripts/device_install.sh (the package with the CUDA backend; a warm machine rebuilds
#    little; SKIP_INSTALL=1 skips it).
# 2. accuracy.py with float32 activations: every state mode, L = 8, 16, 32, 16 streams of 8192
#    bytes, free-running 1024 tokens, the float64 reference over 4 streams (about 2-3 minutes for
#    both models; the log states each mode's time and the step time). Within BUDGET_S seconds
#    (default 200): ':8' and ':32' modes that would overrun are skipped (the JSON lists them);
#    the pass is stopped at TIMEOUT_S (default 420), keeping the models it finished.
# 3. If step 2 took under BF16_IF_UNDER_S seconds (default 120): the base modes again with
#    bfloat16 activations (how the models are served), without the float64 reference.
#
# Writes to $OUT: accuracy_float32.{json,md,log}, accuracy_bfloat16.{json,md,log}, pip.log.
# Prints the tables. MODELS="dir ..." and ACCURACY_ARGS="..." override the models and add flags;
# PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
: "${OUT:?set OUT to the output directory}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
read -r -a models <<<"${MODELS:-study/models/nemotron_h study/models/qwen3_5}"
model_args=()
for m in "${models[@]}"; do
  [ -f "$m/model.safetensors" ] && [ -f "$m/heldout.txt" ] || {
    echo "no trained model in $m (model.safetensors, heldout.txt): unpack device_train.sh's output first"
    exit 1
  }
  model_args+=(--model "$(cd "$m" && pwd)")
done

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  scripts/device_install.sh "$OUT/pip.log" || exit 1
fi

cd /tmp  # import the installed package, not the source tree
run() {  # run <dtype> [accuracy.py flags...]
  local dtype=$1
  shift
  local start=$SECONDS
  timeout "${TIMEOUT_S:-420}" "$python" "$root/study/accuracy.py" "${model_args[@]}" \
    --dtype "$dtype" --budget-s "${BUDGET_S:-200}" --out "$OUT/accuracy_$dtype.json" "$@" \
    ${ACCURACY_ARGS:-} >"$OUT/accuracy_$dtype.log" 2>&1
  local rc=$?
  elapsed=$((SECONDS - start))
  echo "accuracy.py --dtype $dtype: rc=$rc in $elapsed s"
  [ -f "$OUT/accuracy_$dtype.md" ] && cat "$OUT/accuracy_$dtype.md"
  [ $rc = 0 ] || tail -n 30 "$OUT/accuracy_$dtype.log"
  return $rc
}
run float32 || exit 1
if [ "$elapsed" -lt "${BF16_IF_UNDER_S:-120}" ]; then
  run bfloat16 --float64-streams 0 \
    --modes eager-bf16,replay-fp32,replay-bf16,replay-fp32+bf16,replay-fp32+fp8
else
  echo "bfloat16 pass skipped: the float32 pass took $elapsed s (BF16_IF_UNDER_S=${BF16_IF_UNDER_S:-120})"
fi
