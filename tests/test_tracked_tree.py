"""The tracked tree stays small: every GPU call carries it (at most 64 MiB with what it builds), so its
size is staging time. Results rows keep their per-sample records gzipped beside eval.json and their
report figures out of git (linearize.eval.results_file, .gitignore)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREE_LIMIT = 10 * 1024 * 1024
EVAL_JSON_LIMIT = 64 * 1024


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in listed.decode().split("\0") if name]


def test_the_tracked_tree_is_at_most_10_mib():
    sizes = {path: path.stat().st_size for path in tracked_files() if path.is_file()}
    largest = sorted(sizes, key=sizes.get)[-5:]
    assert sum(sizes.values()) <= TREE_LIMIT, [f"{p.relative_to(ROOT)}: {sizes[p]}" for p in largest]


def test_results_files_keep_their_records_out_of_the_json():
    files = [path for path in tracked_files() if path.name == "eval.json" and "docs/results" in path.as_posix()]
    assert files
    too_big = [f"{p.relative_to(ROOT)}: {p.stat().st_size}" for p in files if p.stat().st_size > EVAL_JSON_LIMIT]
    assert not too_big, "split them with experiments/scripts/split_samples.py: " + ", ".join(too_big)
