#!/usr/bin/env bash
# Several session.sh parts in one GPU call: each argument is a chain "GPUS: PART [NAME...], PART ...",
# run in order on those GPUs, all chains at once, none past the call's deadline (default 560 s from now):
#   source experiments/gpu/env.sh && bash experiments/gpu/together.sh "0: tests, kernels" "1: rows teacher" "1: rows lizard"
# Chains that share a GPU share its time: keep timings (kernels, train, model, fsdp) on a GPU of their own.
set -uo pipefail
export DEADLINE=${DEADLINE:-$(($(date +%s) + 560))}
touch "$OUT/steps.txt"
i=0
for chain in "$@"; do
  i=$((i + 1))
  IFS=, read -ra parts <<< "${chain#*:}"
  (
    export CUDA_VISIBLE_DEVICES=${chain%%:*}
    for part in "${parts[@]}"; do
      read -ra words <<< "$part"
      bash experiments/gpu/session.sh "${words[@]}"
    done
  ) > "${CHAINS:-/tmp}/chain-$i.out" 2>&1 &
done
wait
for ((j = 1; j <= i; j++)); do
  echo "##### chain $j: ${!j}"
  tail -n 25 "${CHAINS:-/tmp}/chain-$j.out"
done
echo "##### steps"
cat "$OUT/steps.txt"
