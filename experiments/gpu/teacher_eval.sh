#!/usr/bin/env bash
# The teacher's figures in docs/evaluation-teacher.md, as run on one H200 (bf16):
#   bash experiments/gpu/teacher_eval.sh RESULTS_DIR [STEP...]      STEP: zeroshot mmlu ppl longcontext (default: all)
# MODEL=... evaluates another model the same way.
set -euo pipefail
out=${1:?results dir}
shift
steps=${*:-zeroshot mmlu ppl longcontext}
model=${MODEL:-smollm2}
mkdir -p "$out"
run() { echo "+ linearize eval $*"; /usr/bin/time -f "%e s" python -m linearize.cli eval --model "$model" --device cuda --dtype bfloat16 "$@"; }
for step in $steps; do
  case $step in
    zeroshot) run --tasks zeroshot --batch 64 --out "$out/zeroshot.json" ;;
    # lm-eval tokenizes MMLU's 56K requests at ~110/s on that machine's CPU: 20 questions per subject
    # (1,140 of 14,042) keep it inside one 10-minute call.
    mmlu) run --tasks mmlu --task-limit mmlu=20 --batch 64 --out "$out/mmlu.json" ;;
    ppl) run --tasks ppl --lengths 512,2k,8k,32k --batch 8 --out "$out/ppl.json" ;;
    longcontext) run --tasks passkey,niah_single --lengths 1k,2k,4k,8k,16k,32k --samples 2 --batch 16 \
                   --out "$out/longcontext.json" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
