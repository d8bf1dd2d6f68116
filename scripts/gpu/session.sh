#!/usr/bin/env bash
# One GPU call's worth of the planned runs (scripts/gpu/README.md), each step under its own limit:
#   source scripts/gpu/env.sh && bash scripts/gpu/session.sh PART [NAME...]
# PART: tests | kernels | train [METHOD SEQ_LEN BATCH] | fsdp (2 GPUs) | model | rows NAME... (recipes/NAME.json)
# | teacher | after TAG (waits until the part tagged TAG has finished, e.g. `after fsdp`, then ends).
# Logs and results come back as one $OUT/PART[-NAME...].tgz (at most 8 files come back from a call);
# scripts/gpu/together.sh runs several parts at once, on one GPU or both.
set -uo pipefail
source scripts/gpu/step.sh
part=${1:?part}
shift
tag=$(IFS=-; echo "$part${*:+-$*}")
export LOGS=/tmp/res/$tag
res=$LOGS
mkdir -p "$res"
case $part in
  tests)
    step tests 420 python -m pytest -q -m gpu tests/test_gpu.py tests/kernels -p no:cacheprovider ;;
  kernels)
    step check 300 python -m linearize.kernels.check --no-check
    step sweep 240 python -m linearize.kernels.check --no-check --no-bench --sweep --lengths 2048 ;;
  train)
    step train 200 python -m linearize.cli bench train --model smollm2 --method "${1:-lizard}" \
      --seq-len "${2:-2048}" --batch "${3:-8}" --profile --out "$res/train" ;;
  after)
    while [ ! -f "$OUT/$1.tgz" ] && [ "$(date +%s)" -lt "${DEADLINE:-0}" ]; do sleep 5; done
    exit ;;
  fsdp)
    step fsdp 400 python scripts/gpu/fsdp_check.py --gpus 2 --steps 16 --batch 16 --out "$res/fsdp" ;;
  model)
    step model_smollm2 270 python -m linearize.cli bench model --time-limit 240 --out "$res/model-smollm2"
    step model_8b 300 python -m linearize.cli bench model --shape llama3-8b --time-limit 270 \
      --out "$res/model-llama3-8b" ;;
  rows)
    recipes=()
    for name in "$@"; do recipes+=("recipes/$name.json"); done
    step rows 570 python -m linearize.cli recipe run "${recipes[@]}" --out /tmp/runs
    # The runs stay in /tmp/runs (a later call on a warm machine resumes them); weights and checkpoints
    # stay there, the training logs come back.
    runs=()
    for name in "$@"; do [ -d "/tmp/runs/$name" ] && runs+=(-C /tmp/runs "$name"); done
    tar czf "$OUT/$tag.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude=checkpoint --exclude='*.gguf' \
      -C /tmp/res "$tag" "${runs[@]}"
    exit ;;
  teacher)
    step teacher 570 bash scripts/gpu/teacher_eval.sh "$res/teacher" mmlu longcontext ;;
  *)
    echo "unknown part $part" >&2
    exit 2 ;;
esac
tar czf "$OUT/$tag.tgz" -C /tmp/res "$tag"
