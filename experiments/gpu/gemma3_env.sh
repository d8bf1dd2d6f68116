# Sourced on the GPU machine after experiments/gpu/env.sh, once stage_gemma3.sh's parts are in
# /tmp/gemma3.part1, part2, ... and /tmp/tokenizer.tgz: joins the GGUF into the asset cache (checksummed) and
# builds the dense folder from it offline, so the alias `gemma3` resolves.
if [ ! -d "$LINEARIZE_CACHE/gemma3/hf-bfloat16" ]; then
  mkdir -p "$LINEARIZE_CACHE/gemma3" /tmp/gemma3-tokenizer
  i=1
  while [ -f "/tmp/gemma3.part$i" ]; do cat "/tmp/gemma3.part$i"; i=$((i + 1)); done \
    > "$LINEARIZE_CACHE/gemma3/gemma-3-270m-q4_k_m.gguf"
  echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  $LINEARIZE_CACHE/gemma3/gemma-3-270m-q4_k_m.gguf" |
    sha256sum -c --quiet
  tar xzf /tmp/tokenizer.tgz -C /tmp/gemma3-tokenizer
  python -c "from pathlib import Path; from linearize import assets; assets.gemma3_hf(tokenizer=Path('/tmp/gemma3-tokenizer'))"
fi
