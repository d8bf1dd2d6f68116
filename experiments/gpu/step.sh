# Sourced in a GPU command: `step NAME SECONDS CMD...` runs CMD under a time limit, keeps its output in
# $LOGS/NAME.log ($LOGS defaults to $OUT) and its status in $OUT/steps.txt, and goes on either way, so one
# failing step still leaves the others' results in a call. At the limit CMD gets SIGINT, as from Ctrl-C,
# so `distill` saves a checkpoint (the next call resumes it) and `eval` keeps its finished tasks; SIGKILL
# 20 s later. With $DEADLINE (epoch seconds) set, no step runs past it: the call's own limit.
# $STEP_LIMIT replaces every step's own limit (experiments/gpu/background.sh: parts that outlive a call).
step() {
  local name=$1 limit=${STEP_LIMIT:-$2}
  shift 2
  if [ -n "${DEADLINE:-}" ]; then
    local left=$((DEADLINE - $(date +%s) - 25))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
      echo "$name skipped: the call's deadline is near" | tee -a "$OUT/steps.txt"
      return
    fi
  fi
  local began=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee "${LOGS:-$OUT}/$name.log" | tail -n 40
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc $((SECONDS - began))s" | tee -a "$OUT/steps.txt"
}
