#!/usr/bin/env bash
# Stages the second teacher, Gemma-3-270M, for the GPU machine (no network there): its GGUF (242 MiB)
# in five parts, .device/g1 .. .device/g5, and its tokenizer files (the dense folder without its
# weights) as .device/g0/tokenizer.tgz. Run after stage_assets.sh; fetches the teacher here first
# (`python -m linearize.assets fetch --only gemma3-hf`) if it is not in the cache yet.
#   call 1: carry [".device/assets", ".device/g0"]: source experiments/gpu/env.sh; cp .device/g0/tokenizer.tgz /tmp/
#   calls 2-6: carry [".device/gN"]: cp .device/gN/part /tmp/gemma3.partN
#   then: source experiments/gpu/env.sh && source experiments/gpu/gemma3_env.sh   (`gemma3` now resolves)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
gguf=$(.venv/bin/python -m linearize.assets path gemma3)
hf=$(.venv/bin/python -m linearize.assets path gemma3-hf)
rm -rf .device/g0 .device/g1 .device/g2 .device/g3 .device/g4 .device/g5
mkdir -p .device/g0
tar czf .device/g0/tokenizer.tgz -C "$hf" --exclude=model.safetensors .
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
fifth=$(($(stat -c %s "$gguf") / 5 + 1))
split -b "$fifth" -d -a 1 "$gguf" "$scratch/part"
for i in 1 2 3 4 5; do
  mkdir -p ".device/g$i"
  mv "$scratch/part$((i - 1))" ".device/g$i/part"
done

limit=$((64 * 1024 * 1024))
tracked=$(($(git ls-files -z | du --files0-from=- -c | tail -1 | cut -f1) * 1024))
for carry in "assets g0" g1 g2 g3 g4 g5; do
  size=0
  for dir in $carry; do size=$((size + $(du -s ".device/$dir" | cut -f1) * 1024)); done
  echo "call carrying $carry: $(((size + tracked) / 1048576)) MiB of the 64 MiB"
  if [ $((size + tracked)) -gt "$limit" ]; then
    echo "too large for a device call: split the teacher in more parts" >&2
    exit 1
  fi
done
