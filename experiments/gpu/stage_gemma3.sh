#!/usr/bin/env bash
# Stages the second teacher, Gemma-3-270M, for the GPU machine (no network there): its GGUF (242 MiB)
# in as many parts as the 64 MiB a call carries needs beside the tracked tree (7 with a 24 MiB tree),
# .device/g1 .. .device/gN, and its tokenizer files (the dense folder without its weights) as
# .device/g0/tokenizer.tgz. Run after stage_assets.sh; fetches the teacher here first
# (`python -m linearize.assets fetch --only gemma3-hf`) if it is not in the cache yet.
#   call 1: carry [".device/assets", ".device/g0"]: source experiments/gpu/env.sh; cp .device/g0/tokenizer.tgz /tmp/
#   calls 2 to N+1: carry [".device/gK"]: cp .device/gK/part /tmp/gemma3.partK
#   then: source experiments/gpu/env.sh && source experiments/gpu/gemma3_env.sh   (`gemma3` now resolves)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
gguf=$(.venv/bin/python -m linearize.assets path gemma3)
hf=$(.venv/bin/python -m linearize.assets path gemma3-hf)
rm -rf .device/g[0-9]*
mkdir -p .device/g0
tar czf .device/g0/tokenizer.tgz -C "$hf" --exclude=model.safetensors .

limit=$((64 * 1024 * 1024))
tracked=$(($(git ls-files -z | du --files0-from=- -c | tail -1 | cut -f1) * 1024))
# A part leaves 2 MiB of the call for the tree to grow by (new results) before the teacher must be
# staged again.
room=$((limit - tracked - 2 * 1024 * 1024))
size=$(stat -c %s "$gguf")
parts=$(((size + room - 1) / room))
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
split -n "$parts" -d -a 2 "$gguf" "$scratch/part"
carries=("assets g0")
for ((i = 1; i <= parts; i++)); do
  mkdir -p ".device/g$i"
  mv "$scratch/part$(printf %02d $((i - 1)))" ".device/g$i/part"
  carries+=("g$i")
done
for carry in "${carries[@]}"; do
  size=0
  for dir in $carry; do size=$((size + $(du -s ".device/$dir" | cut -f1) * 1024)); done
  echo "call carrying $carry: $(((size + tracked) / 1048576)) MiB of the 64 MiB"
  if [ $((size + tracked)) -gt "$limit" ]; then
    echo "too large for a device call: move files out of the tracked tree or carry assets and g0 apart" >&2
    exit 1
  fi
done
