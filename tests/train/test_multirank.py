"""The multi-rank path for real: `torchrun --nproc-per-node 2` on CPU (gloo, FSDP2) vs one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_distill import log

TORCHRUN = Path(sys.executable).parent / "torchrun"  # installed with torch, beside this interpreter


def torchrun(nproc: int, workspace: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(TORCHRUN), f"--nproc-per-node={nproc}",
           "--standalone", "-m", "linearize.cli", "distill",
           "--model", str(workspace / "teacher"), "--method", "lizard", "--data", str(workspace / "data.txt"),
           "--out", str(out), "--device", "cpu", "--max-tokens", str(6 * 4 * 32), "--seq-len", "32", "--batch", "4",
           "--save-every", "3", "--eval-every", "6", "--set", "window=8", "--set", "num_sinks=2", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)


def losses(out: Path, stage: int) -> list[float]:
    return [r["loss"] for r in log(out) if r["stage"] == stage and "loss" in r]


@pytest.mark.slow
def test_two_ranks_follow_the_one_rank_loss_curve(workspace, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for n, out in ((1, one), (2, two)):
        proc = torchrun(n, workspace, out)
        assert proc.returncode == 0, proc.stderr[-4000:]
    for stage in (1, 2):
        a, b = losses(one, stage), losses(two, stage)
        assert len(a) == len(b) == 6
        for x, y in zip(a, b):
            assert abs(x - y) <= 1e-3 * abs(x), (stage, a, b)
    assert json.loads((two / "distill_config.json").read_text())["method"] == "lizard"
    # A second start on the finished directory is refused on every rank alike, with the one-line error.
    again = torchrun(2, workspace, two)
    assert again.returncode != 0 and "already holds a run" in again.stderr
