#!/usr/bin/env bash
# The teacher's figures in docs/evaluation-teacher.md, as run on one H200 (bf16):
#   bash scripts/gpu/teacher_eval.sh RESULTS_DIR [MODEL]
set -euo pipefail
out=${1:?results dir}
model=${2:-smollm2}
mkdir -p "$out"
run() { echo "+ linearize eval $*"; /usr/bin/time -f "%e s" python -m linearize.cli eval --model "$model" --device cuda --dtype bfloat16 "$@"; }
run --tasks zeroshot --batch 64 --out "$out/zeroshot.json"
run --tasks mmlu --batch 64 --out "$out/mmlu.json"
run --tasks ppl --lengths 512,2k,8k,32k --batch 8 --out "$out/ppl.json"
run --tasks passkey,niah_single --lengths 1k,2k,4k,8k,16k,32k --batch 16 --out "$out/longcontext.json"
