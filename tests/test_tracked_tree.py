"""The tracked tree stays small: every GPU call carries it (at most 64 MiB with what it builds), so its
size is staging time. The carry counts each file in whole 4 KiB disk blocks (as `du` does), so a small
file costs a block however few its bytes. Results rows keep their per-sample records gzipped beside
eval.json, their JSON a line per entry (linearize.cli_args.compact_json) and their figures out of git
unless a page shows them (.gitignore)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 4096
TREE_LIMIT = 10 * 1024 * 1024
EVAL_JSON_LIMIT = 64 * 1024


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in listed.decode().split("\0") if name]


def in_blocks(size: int) -> int:
    """The bytes a file of `size` bytes takes on disk: whole blocks, an empty file none."""
    return -(-size // BLOCK) * BLOCK


def test_a_file_takes_whole_blocks():
    assert [in_blocks(n) for n in (0, 1, BLOCK, BLOCK + 1)] == [0, BLOCK, BLOCK, 2 * BLOCK]


def test_the_tracked_tree_is_at_most_10_mib_in_disk_blocks():
    blocks = {path: in_blocks(path.stat().st_size) for path in tracked_files() if path.is_file()}
    largest = sorted(blocks, key=blocks.get)[-5:]
    assert sum(blocks.values()) <= TREE_LIMIT, [f"{p.relative_to(ROOT)}: {blocks[p]}" for p in largest]


def test_results_files_keep_their_records_out_of_the_json():
    files = [path for path in tracked_files() if path.name == "eval.json" and "docs/results" in path.as_posix()]
    assert files
    too_big = [f"{p.relative_to(ROOT)}: {p.stat().st_size}" for p in files if p.stat().st_size > EVAL_JSON_LIMIT]
    assert not too_big, "split them with experiments/scripts/split_samples.py: " + ", ".join(too_big)
