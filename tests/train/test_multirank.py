"""The multi-rank path for real: `torchrun --nproc-per-node 2` on CPU (gloo, FSDP2) vs one process."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distill import log
from tiny_models import tiny_teacher, tiny_tokenizer

from linearize.loading import load_model

TORCHRUN = Path(sys.executable).parent / "torchrun"  # installed with torch, beside this interpreter
DISTILL = ("-m", "linearize.cli", "distill")


def torchrun(nproc: int, workspace: Path, out: Path, *extra: str, entry=DISTILL,
             device: str = "cpu") -> subprocess.CompletedProcess:
    cmd = [str(TORCHRUN), f"--nproc-per-node={nproc}", "--standalone", *entry,
           "--model", str(workspace / "teacher"), "--method", "lizard", "--data", str(workspace / "data.txt"),
           "--out", str(out), "--device", device, "--max-tokens", str(6 * 4 * 32), "--seq-len", "32", "--batch", "4",
           "--save-every", "3", "--eval-every", "6", "--set", "window=8", "--set", "num_sinks=2", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)


def failure(proc: subprocess.CompletedProcess) -> str:
    """A failed torchrun's one-line `linearize: error:` messages (a rank's own cause, which the other
    rank's long traceback would push out of the tail), then the tail of its stderr."""
    errors = [line for line in proc.stderr.splitlines() if "linearize: error:" in line]
    return "\n".join([*errors, proc.stderr[-4000:]])


def losses(out: Path, stage: int) -> list[float]:
    return [r["loss"] for r in log(out) if r["stage"] == stage and "loss" in r]


@pytest.mark.slow
def test_two_ranks_follow_the_one_rank_loss_curve(workspace, tmp_path):
    one, two, gathered, replicated, replicas = (tmp_path / name for name in
                                                ("one", "two", "gathered", "replicated", "replicas"))
    runs = ((1, one, ()), (2, two, ()), (2, gathered, ("--no-fsdp-reshard",)), (2, replicated, ("--fsdp-replicate",)),
            (2, replicas, ("--no-fsdp", "--cuda-graph")))
    for n, out, extra in runs:
        proc = torchrun(n, workspace, out, *extra)
        assert proc.returncode == 0, failure(proc)
    for stage in (1, 2):
        a, b = losses(one, stage), losses(two, stage)
        assert len(a) == len(b) == 6
        for x, y in zip(a, b):
            assert abs(x - y) <= 1e-3 * abs(x), (stage, a, b)
    assert losses(gathered, 2) == losses(two, 2)  # keeping layers gathered changes when, not what
    for x, y in zip(losses(replicated, 2), losses(two, 2)):  # whole weights per rank: the same steps
        assert abs(x - y) <= 1e-5 * abs(y), (losses(replicated, 2), losses(two, 2))
    # Without FSDP2: replicas and one all-reduce of the gradients, as stage 1 trains; the same steps again.
    for x, y in zip(losses(replicas, 2), losses(two, 2), strict=True):
        assert abs(x - y) <= 1e-5 * abs(y), (losses(replicas, 2), losses(two, 2))
    # Asked for graphs, gloo ranks on the CPU step eagerly and say why; a sharded stage would name FSDP2.
    paths = {r["step_path"] for r in log(replicas) if "loss" in r}
    assert paths == {"eager (parameters not on a CUDA device)"}, paths
    assert json.loads((two / "distill_config.json").read_text())["method"] == "lizard"
    # A second start on the finished directory is refused on every rank alike, with the one-line error.
    again = torchrun(2, workspace, two)
    assert again.returncode != 0 and "already holds a run" in again.stderr


@pytest.mark.slow
def test_two_ranks_train_and_score_the_kl_candidates_as_one_does(workspace, tmp_path):
    """KL-guided selection with trained candidates: each candidate's steps average the ranks' gradients
    and its KL their validation means, so two ranks score (and pick) as one rank does."""
    # A sharp teacher (ten times the default init width), as in test_layer_selection: its KLs (~1 nat)
    # stand well above the ranks' float32 reduction-order noise.
    sharp = tmp_path / "workspace"
    tiny_teacher(initializer_range=0.2).save_pretrained(sharp / "teacher")
    tiny_tokenizer().save_pretrained(sharp / "teacher")
    shutil.copy(workspace / "data.txt", sharp / "data.txt")
    scores = {}
    for n in (1, 2):
        out = tmp_path / str(n)
        proc = torchrun(n, sharp, out, "--softmax-by", "kl:1", "--kl-train-steps", "2", "--no-fsdp")
        assert proc.returncode == 0, failure(proc)
        scores[n] = json.loads((out / "stage1_layer_errors.json").read_text())
    one, two = scores[1], scores[2]
    assert two["kl_train_steps"] == 2 and two["picked"] == one["picked"]
    assert two["kl_all_linear"] == pytest.approx(one["kl_all_linear"], rel=1e-3)
    assert two["kl_restored"] == pytest.approx(one["kl_restored"], rel=1e-3)


@pytest.mark.slow
def test_no_rank_reads_a_checkpoint_the_main_rank_is_still_writing(workspace, tmp_path):
    """Stage 1's last checkpoint is written by rank 0 alone, and stage 2 opens by reading it: the
    other rank must wait for the write, or it finds the checkpoint mid-replacement (a
    FileNotFoundError, exit status 2, in one CI run of the two-rank tests)."""
    proc = torchrun(2, workspace, tmp_path / "out", entry=(str(Path(__file__).with_name("slow_checkpoint_distill.py")),))
    assert proc.returncode == 0, failure(proc)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--fsdp-replicate",), ("--no-fsdp",)], ids=["sharded", "replicated", "replicas"])
def test_an_interrupted_two_rank_run_resumes_on_two_ranks_or_one(workspace, tmp_path, extra):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert torchrun(2, workspace, straight, *extra).returncode == 0
    interrupted = torchrun(2, workspace, cut, *extra,
                           entry=(str(Path(__file__).with_name("interrupted_distill.py")), "5"))
    assert interrupted.returncode != 0, interrupted.stderr[-4000:]
    assert "interrupted: checkpoint at step 4" in interrupted.stdout, interrupted.stdout[-2000:] + interrupted.stderr[-4000:]
    one_rank = tmp_path / "one_rank"
    shutil.copytree(cut, one_rank)

    for nproc, out in ((2, cut), (1, one_rank)):
        proc = torchrun(nproc, workspace, out, "--resume", *extra)
        assert proc.returncode == 0, failure(proc)
    # On the same ranks the resumed run is the uninterrupted one, bit for bit.
    a, b = load_model(straight), load_model(cut)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    steps = lambda out: {r["step"]: r["loss"] for r in log(out) if r["stage"] == 2 and "loss" in r}
    assert steps(cut) == steps(straight)
    # The checkpoint holds full tensors, so one rank picks it up too (other reduction order: 1e-3).
    for step, loss in steps(one_rank).items():
        assert abs(loss - steps(straight)[step]) <= 1e-3 * abs(loss), step


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpu_replicas_replay_graphed_steps_on_the_one_gpu_loss_curve(workspace, tmp_path):
    """`--no-fsdp --cuda-graph` on two GPUs: both stages' steps, the NCCL all-reduce of the gradients
    included, replay from CUDA graphs, and the losses follow one graphed GPU's at the same global batch."""
    one, two = tmp_path / "one", tmp_path / "two"
    for n, out in ((1, one), (2, two)):
        proc = torchrun(n, workspace, out, "--no-fsdp", "--cuda-graph", "--eval-every", "24", "--max-tokens",
                        str(24 * 4 * 32), device="cuda")
        assert proc.returncode == 0, failure(proc)
    for stage in (1, 2):
        records = [r for r in log(two) if r["stage"] == stage and "loss" in r]
        # Three eager warm-up steps, then the capture: every later step replays it.
        assert {r["step_path"] for r in records[4:]} == {"cuda graph"}, [r["step_path"] for r in records]
        a, b = losses(one, stage), losses(two, stage)
        assert len(a) == len(b) == 24
        for x, y in zip(a, b):
            assert abs(x - y) <= 2e-2 * abs(x), (stage, a, b)
