# Sourced in a GPU command: `step NAME SECONDS CMD...` runs CMD under a time limit, keeps its output in
# $OUT/NAME.log and its status in $OUT/steps.txt, and goes on either way, so one failing step still
# leaves the others' results in a call.
step() {
  local name=$1 limit=$2
  shift 2
  local began=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 40
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc $((SECONDS - began))s" | tee -a "$OUT/steps.txt"
}
