#!/usr/bin/env bash
# Runs experiments/gpu/together.sh detached from the call (setsid), so that its parts go on across
# calls while the machine stays warm; later calls poll it and bring its results back:
#   bash experiments/gpu/background.sh start SECONDS "0: rows gemma3-lizard" ...   (returns at once)
#   bash experiments/gpu/background.sh wait SECONDS    (sleeps until it ends or SECONDS pass; copies its results to $OUT)
# A call must come every ~30 s or the machine goes back, taking the detached parts with it.
set -uo pipefail
BG=${BG:-/tmp/bg}  # another BG runs a second set beside the first
RUNS=${RUNS:-/tmp/runs}  # where session.sh's rows and distill parts put their runs
case ${1:?start or wait} in
  start)
    seconds=${2:?seconds}
    shift 2
    # A set started again (after a failed start) must not bring back the last one's files as its own.
    rm -rf "$BG/out" "$BG/done" "$BG/rows" "$BG"/chain-*.out && mkdir -p "$BG/out"
    # A later call replaces the working tree under it: the detached parts run from their own copy.
    rm -rf "$BG/repo" && mkdir -p "$BG/repo" && cp -r linearize experiments recipes tests pyproject.toml "$BG/repo/"
    cd "$BG/repo" && export PYTHONPATH="/tmp/site:$BG/repo"
    setsid bash -c 'export CHAINS="$0" OUT="$0/out" ROWS_FILE="$0/rows" DEADLINE=$(($(date +%s) + $1)) STEP_LIMIT=$1; shift; bash experiments/gpu/together.sh "$@"; touch '"$BG"'/done' \
      "$BG" "$seconds" "$@" > "$BG/log" 2>&1 < /dev/null &
    echo "started: $*" ;;
  wait)
    end=$(($(date +%s) + ${2:?seconds}))
    # Results are copied as each part ends, not only at the end: a call killed at its limit (the
    # device tool lowers it to the session's device time left) still brings back what had finished.
    while [ ! -f "$BG/done" ] && [ "$(date +%s)" -lt "$end" ]; do cp -ru "$BG/out/." "$OUT/"; sleep 5; done
    cp -ru "$BG/out/." "$OUT/"
    # This set's rows still running come back as they stand (logs, eval.json so far: the files under
    # 2 MB, not weights or checkpoints), in case the session's device time ends before they do. A set
    # beside this one shares the runs folder: only the rows session.sh named in $BG/rows come back.
    dirs=()
    while read -r row; do [ -d "$RUNS/$row" ] && dirs+=("$(basename "$RUNS")/$row"); done < <(sort -u "$BG/rows" 2>/dev/null)
    [ ${#dirs[@]} -gt 0 ] && (cd "$(dirname "$RUNS")" && find "${dirs[@]}" -type f -size -2000k -print0 |
      tar czf "$OUT/runs-so-far.tgz" --null -T -)
    # The results are in $OUT before anything is printed: a reader that stops early (`| head`) ends
    # this script with SIGPIPE, which must not cost them.
    state=$([ -f "$BG/done" ] && echo "finished" || echo "still running")
    # First and last: the tails' progress-bar frames can be longer than the 12,000 characters a reply keeps.
    echo "$state"
    tail -n 40 "$BG/log"
    for f in "$BG"/chain-*.out; do [ -f "$f" ] && { echo "== $f"; tail -n 6 "$f"; }; done
    echo "$state"
    true ;;
esac
