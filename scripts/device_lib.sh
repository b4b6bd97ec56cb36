#!/usr/bin/env bash
# The phases a GPU run script shares (install, test, bench), sourced by scripts/device_e2e.sh
# and scripts/device_spec.sh, which name their test files and benchmark:
#   device_setup NAME PHASES...       cd to the repository, $OUT and $OUT/logs, the GPU's line,
#                                     the install phase; PHASES default to install test bench
#   device_test TIMEOUT LABEL FILES... the test phase: pytest -m cuda on FILES (relative to the
#                                     repository; missing ones skipped) into $OUT/pytest.log
#   device_bench PATTERN              the bench phase: python -m replayssm.bench_NAME
#                                     (BENCH_ARGS replaces its arguments) into $OUT/bench_NAME.*;
#                                     its lines matching PATTERN go to the summary
# Each phase logs one line to $OUT/summary.txt and stdout; logs.tar.gz gathers $OUT/logs at exit.

device_setup() {
  device_name=$1
  shift
  cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit
  root=$PWD
  OUT=${OUT:-$root/out}
  mkdir -p "$OUT" "$OUT/logs"
  export PYTHONUNBUFFERED=1
  phases=${*:-install test bench}
  trap device_finish EXIT
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    >>"$OUT/summary.txt" 2>&1
  if device_phase install; then
    msg=$(scripts/device_install.sh "$OUT/logs/pip.log")
    rc=$?
    device_log "$msg"
    [ $rc = 0 ] || exit 1
  fi
}

device_log() { echo "[device_$device_name $(date +%T)] $*" | tee -a "$OUT/summary.txt"; }
device_finish() { tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"; }
device_phase() { [[ " $phases " == *" $1 "* ]]; }

device_test() {
  local timeout_s=$1 label=$2 start rc f
  shift 2
  device_phase test || return 0
  local tests=()
  for f in "$@"; do
    [ -e "$root/$f" ] && tests+=("$root/$f")
  done
  start=$(date +%s)
  # from /tmp: import the installed package, not the source tree
  (cd /tmp && timeout "$timeout_s" python3 -m pytest -v --tb=short -rs -p no:cacheprovider \
    -m cuda -o faulthandler_timeout=120 "${tests[@]}" >"$OUT/pytest.log" 2>&1)
  rc=$?
  device_log "pytest -m cuda${label:+ $label}: rc=$rc in $(( $(date +%s) - start )) s:" \
    "$(tail -1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20 | tee -a "$OUT/summary.txt"
}

device_bench() {
  local pattern=$1 bench=bench_$device_name start rc
  device_phase bench || return 0
  start=$(date +%s)
  # shellcheck disable=SC2086
  (cd /tmp && timeout 330 python3 -m "replayssm.$bench" ${BENCH_ARGS:-} \
    --json "$OUT/$bench.json" >"$OUT/$bench.txt" 2>"$OUT/logs/$bench.stderr")
  rc=$?
  device_log "$bench: rc=$rc in $(( $(date +%s) - start )) s"
  tail -3 "$OUT/logs/$bench.stderr" >>"$OUT/summary.txt"
  grep -E "$pattern" "$OUT/$bench.txt" | tee -a "$OUT/summary.txt"
}
