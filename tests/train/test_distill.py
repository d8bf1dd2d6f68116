"""Distillation on tiny models: losses fall, only the intended tensors move, resume is exact."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from interrupted_distill import interrupting_stage_loss

from linearize.loading import load_model
from linearize.train import DistillConfig, ResumeError, checkpoint, distill, run_dir, stage_loop
from linearize.train import distillation as distill_module
from linearize.train.student import new_parameter_names

ROOT = Path(__file__).resolve().parents[2]


def config(workspace, out, **overrides):
    base = {"model": str(workspace / "teacher"), "method": "lizard", "out": str(out), "data": str(workspace / "data.txt"),
                "max_tokens": 4 * 32 * 8, "seq_len": 32, "batch": 4, "options": {"window": 8, "num_sinks": 2}, "save_every": 3,
                "eval_every": 4, "val_batches": 1, "lr_stage1": 3e-2, "lr_stage2": 2e-3}
    return DistillConfig(**{**base, **overrides})


def log(out):
    return [json.loads(line) for line in (Path(out) / "train_log.jsonl").read_text().splitlines()]


def test_both_stages_reduce_their_losses_and_export_a_model(workspace, tmp_path):
    # The tiny random teacher attends almost uniformly, which Lizard's linear part matches at once (a
    # stage-1 loss of ~1e-16 at alpha = 0): alpha starts at 1 here so that stage 1 has something to learn.
    options = {"window": 8, "num_sinks": 2, "alpha_init": 1.0}
    out = distill(config(workspace, tmp_path / "run", max_tokens=4 * 32 * 16, options=options), progress=False)
    records = log(out)
    for stage in (1, 2):
        val = [r["val_loss"] for r in records if r["stage"] == stage and r.get("split") == "val"]
        assert val[-1] < val[0], (stage, val)
        train = [r for r in records if r["stage"] == stage and "loss" in r]
        assert {"stage", "step", "tokens", "loss", "lr", "tokens_per_s", "step_s"} <= set(train[0])
        assert all(r["step_s"] > 0 for r in train)
        assert train[-1]["tokens"] == 16 * 4 * 32
    model = load_model(out)
    assert model.config.linearize["method"] == "lizard"
    assert not any("lora" in name for name, _ in model.named_parameters())


def test_each_stage_changes_only_its_parameters(workspace, tmp_path):
    teacher = load_model(workspace / "teacher")
    out = distill(config(workspace, tmp_path / "s1", stage="1"), progress=False)
    student = load_model(out)
    new = {n for n, _ in student.named_parameters()} - {n for n, _ in teacher.named_parameters()}
    teacher_params = dict(teacher.named_parameters())
    for name, p in student.named_parameters():
        if name not in new:
            assert torch.equal(p, teacher_params[name]), name
    stage1 = torch.load(Path(out) / "stage1_attention.pt")
    assert set(stage1) == new

    out2 = distill(config(workspace, tmp_path / "s2", stage="2"), progress=False)
    merged = load_model(out2)
    changed = {n for n, p in merged.named_parameters() if n in teacher_params and not torch.equal(p, teacher_params[n])}
    assert changed and all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) for n in changed)


def test_interrupted_then_resumed_equals_uninterrupted(workspace, tmp_path, monkeypatch):
    straight = distill(config(workspace, tmp_path / "straight"), progress=False)

    real_loss = stage_loop.stage_loss
    # Mid stage-2 step 5: the checkpoint of step 3 is the last one saved before.
    monkeypatch.setattr(stage_loop, "stage_loss", interrupting_stage_loss(5))
    with pytest.raises(KeyboardInterrupt):
        distill(config(workspace, tmp_path / "resumed"), progress=False)
    monkeypatch.setattr(stage_loop, "stage_loss", real_loss)
    with pytest.raises(ResumeError):
        distill(config(workspace, tmp_path / "resumed"), progress=False)  # refuses to overwrite without --resume
    resumed = distill(config(workspace, tmp_path / "resumed"), resume=True, progress=False)

    a, b = load_model(straight), load_model(resumed)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    losses = lambda out: [(r["stage"], r["step"], r["loss"]) for r in log(out) if "loss" in r]
    assert {(s, k): v for s, k, v in losses(resumed)} == {(s, k): v for s, k, v in losses(straight)}


def test_a_run_with_recall_documents_resumes_to_the_same_model(workspace, tmp_path, monkeypatch):
    """The recall blocks are generated when read: an interrupted run resumed reads the batches the straight
    one read (stage 2, where they meet the next-token loss)."""
    settings = {"stage": "2", "recall_share": 0.25}
    straight = distill(config(workspace, tmp_path / "straight", **settings), progress=False)
    real_loss = stage_loop.stage_loss
    monkeypatch.setattr(stage_loop, "stage_loss", interrupting_stage_loss(5))
    with pytest.raises(KeyboardInterrupt):
        distill(config(workspace, tmp_path / "resumed", **settings), progress=False)
    monkeypatch.setattr(stage_loop, "stage_loss", real_loss)
    resumed = distill(config(workspace, tmp_path / "resumed", **settings), resume=True, progress=False)
    for (name, p), (_, q) in zip(load_model(straight).named_parameters(), load_model(resumed).named_parameters()):
        assert torch.equal(p, q), name
    losses = lambda out: {(r["step"], r["loss"]) for r in log(out) if "loss" in r}
    assert losses(resumed) == losses(straight)
    plain = distill(config(workspace, tmp_path / "plain", stage="2"), progress=False)
    assert losses(plain) != losses(straight)  # the recall blocks were trained on


def recording_dtypes(monkeypatch) -> dict:
    """`stage_loop.stage_loss`, noting at each stage's first call the model the trainer built: the dtypes of
    its trained, stage-1 (new) and other frozen parameters and of its buffers, and stage 1's tensors' values."""
    seen, real = {}, stage_loop.stage_loss

    def loss(model, ids, stage):
        if stage not in seen:
            new = new_parameter_names(model)
            params = dict(model.named_parameters())
            seen[stage] = {"trained": {p.dtype for p in params.values() if p.requires_grad},
                           "new": {params[n].dtype for n in new},
                           "frozen": {p.dtype for n, p in params.items() if not p.requires_grad and n not in new},
                           "buffers": {b.dtype for b in model.buffers()},
                           "new_values": {n.removeprefix("base_model.model."): params[n].detach().clone() for n in new}}
        return real(model, ids, stage)

    monkeypatch.setattr(stage_loop, "stage_loss", loss)
    return seen


def test_default_precision_on_the_cpu_keeps_every_tensor_float32(workspace, tmp_path, monkeypatch):
    seen = recording_dtypes(monkeypatch)
    distill(config(workspace, tmp_path / "run", max_tokens=4 * 32 * 2, eval_every=2), progress=False)
    assert set(seen) == {1, 2}
    for stage, dtypes in seen.items():
        assert dtypes["trained"] and dtypes["new"] and dtypes["frozen"]
        assert {*dtypes["trained"], *dtypes["new"], *dtypes["frozen"], *dtypes["buffers"]} == {torch.float32}, stage


def test_a_bf16_run_trains_float32_masters_beside_a_bf16_teacher_resumes_and_exports_float32(workspace, tmp_path,
                                                                                             monkeypatch):
    """--precision bf16 (on the CPU here): each stage's model holds the frozen teacher in bf16, trains float32
    (stage 1's modules, then LoRA) and keeps stage 1's modules float32 in stage 2, as saved. Interrupted and
    resumed, the run equals the straight one; its export is the float32 teacher with the trained tensors in."""
    from transformers import AutoModelForCausalLM

    seen = recording_dtypes(monkeypatch)
    straight = distill(config(workspace, tmp_path / "straight", precision="bf16"), progress=False)
    assert set(seen) == {1, 2}
    assert seen[1]["trained"] == seen[1]["new"] == {torch.float32}
    assert seen[2]["trained"] == seen[2]["new"] == {torch.float32}
    assert seen[1]["frozen"] == seen[2]["frozen"] == {torch.bfloat16}
    assert seen[1]["buffers"] == seen[2]["buffers"] == {torch.float32}  # RoPE's frequencies
    stage1 = torch.load(straight / "stage1_attention.pt")
    assert {t.dtype for t in stage1.values()} == {torch.float32}
    assert seen[2]["new_values"].keys() == stage1.keys()
    assert all(torch.equal(seen[2]["new_values"][n], t) for n, t in stage1.items())

    recording = stage_loop.stage_loss
    monkeypatch.setattr(stage_loop, "stage_loss", interrupting_stage_loss(5))
    with pytest.raises(KeyboardInterrupt):
        distill(config(workspace, tmp_path / "resumed", precision="bf16"), progress=False)
    seen.clear()
    monkeypatch.setattr(stage_loop, "stage_loss", recording)
    resumed = distill(config(workspace, tmp_path / "resumed", precision="bf16"), resume=True, progress=False)
    assert set(seen) == {2} and seen[2]["trained"] == {torch.float32} and seen[2]["frozen"] == {torch.bfloat16}
    losses = lambda out: {(r["stage"], r["step"]): r["loss"] for r in log(out) if "loss" in r}
    assert losses(resumed) == losses(straight)

    teacher = dict(load_model(workspace / "teacher").named_parameters())
    a = dict(AutoModelForCausalLM.from_pretrained(straight).named_parameters())
    b = dict(AutoModelForCausalLM.from_pretrained(resumed).named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert {p.dtype for p in a.values()} == {torch.float32}
    assert all(torch.equal(a[n], t) for n, t in stage1.items())
    merged = {n for n in teacher if not torch.equal(a[n], teacher[n])}  # the LoRA merge, into float32 weights
    assert merged and all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) for n in merged)


def listing(root):
    """Every file under `root` with its size and modification time: what a refused call may not change."""
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def test_resume_refuses_a_different_run(workspace, tmp_path):
    distill(config(workspace, tmp_path / "run", stage="1"), progress=False)
    with pytest.raises(ResumeError, match="seq_len"):
        distill(config(workspace, tmp_path / "run", stage="1", seq_len=16), resume=True, progress=False)


def test_a_refused_resume_shows_each_changed_setting_saved_and_asked(workspace, tmp_path):
    distill(config(workspace, tmp_path / "run", stage="1"), progress=False)
    changed = config(workspace, tmp_path / "run", stage="1", seq_len=16, max_tokens=2048,
                     options={"window": 4, "num_sinks": 2}, softmax_by="even:1")
    with pytest.raises(ResumeError) as error:
        distill(changed, resume=True, progress=False)
    message = str(error.value)
    assert "\n" not in message
    assert message.endswith("these settings differ from the saved run: max_tokens: saved 1024, asked 2048; "
                            "seq_len: saved 32, asked 16; options.window: saved 8, asked 4; "
                            'softmax_by: saved null, asked "even:1"'), message


def test_a_finished_run_is_not_reused_for_other_settings(workspace, tmp_path):
    """`ensure_distilled` (recipes, demo) reuses a finished run only for its own settings: asked for another
    budget, it refuses as --resume does and touches nothing, rather than return the model trained on the old one."""
    from linearize.train import ensure_distilled

    out = distill(config(workspace, tmp_path / "run", stage="1"), progress=False)
    before = listing(out)
    ensure_distilled(config(workspace, out, stage="1", save_every=5), progress=False)  # speed only: reused
    assert listing(out) == before
    with pytest.raises(ResumeError, match="max_tokens: saved 1024, asked 2048$"):
        ensure_distilled(config(workspace, out, stage="1", max_tokens=2048), progress=False)
    assert listing(out) == before


def test_bad_data_path_is_a_clear_error(workspace, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        distill(config(workspace, tmp_path / "run", data=str(tmp_path / "nope.jsonl")), progress=False)
    # Refused before anything was written: the corrected command starts afresh, no --resume needed.
    assert not (tmp_path / "run" / "distill_config.json").exists()


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="stage"):
        DistillConfig(model="m", method="lizard", out="o", stage="3")
    with pytest.raises(ValueError, match="grad_accum"):
        DistillConfig(model="m", method="lizard", out="o", batch=6, grad_accum=4)
    with pytest.raises(ValueError, match="head_lr_scale must be > 0"):
        DistillConfig(model="m", method="lizard", out="o", head_lr_scale=0)
    for fsdp_option in ({"fsdp_replicate": True}, {"fsdp_reshard": False}):
        with pytest.raises(ValueError, match="pick one"):
            DistillConfig(model="m", method="lizard", out="o", fsdp=False, **fsdp_option)
    # Every token of a 1,024-token sequence fits 1,536 slots: STILL's linear state would see none.
    with pytest.raises(ValueError, match="stage 1 would train nothing"):
        DistillConfig(model="m", method="still", out="o", seq_len=1024, options={"budget": 1536})
    DistillConfig(model="m", method="still", out="o", seq_len=2048, options={"budget": 1536})
    DistillConfig(model="m", method="still", out="o", seq_len=1024, stage="2", options={"budget": 1536})


@pytest.mark.parametrize("share", [-0.1, 1.0, float("nan"), "0.2", True])
def test_a_recall_share_outside_zero_to_one_is_rejected(share):
    with pytest.raises(ValueError, match="recall_share"):
        DistillConfig(model="m", method="lizard", out="o", recall_share=share)


def test_the_recall_share_replaces_that_share_of_the_training_blocks(workspace, tmp_path):
    from linearize.data import TokenBlocks
    from linearize.data.recall import MixedBlocks

    plain = distill_module.Run(config(workspace, tmp_path / "plain"), resume=False, progress=False)
    mixed = distill_module.Run(config(workspace, tmp_path / "mixed", recall_share=0.25), resume=False, progress=False)
    assert isinstance(plain.train_blocks, TokenBlocks)  # share 0: the packed data, as without the option
    assert isinstance(mixed.train_blocks, MixedBlocks)
    assert len(mixed.train_blocks) == len(plain.train_blocks) == 32 and len(mixed.train_blocks.recall) == 8
    assert all(torch.equal(a, b) for a, b in zip(mixed.val_blocks, plain.val_blocks))  # validation: the data alone
    assert not (tmp_path / "plain").exists() and not (tmp_path / "mixed").exists()


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf"), "4", True])
def test_a_far_weight_below_zero_or_not_a_number_is_rejected(weight):
    with pytest.raises(ValueError, match="far_weight"):
        DistillConfig(model="m", method="lizard", out="o", far_weight=weight)


def test_the_far_weight_reweights_stage_1_alone_and_a_run_resumes_or_shares_stage_1_only_with_its_own(workspace):
    """prepare_stage hands far_weight to the layers in stage 1 (0 in stage 2, whose loss is next-token); the
    stage-1 loss then moves off the plain one; a run with another far_weight is another stage 1."""
    from linearize.train.losses import stage_loss
    from linearize.train.student import build_student, linearized_layers, prepare_stage

    ids = torch.randint(3, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = {}
    for weight in (0.0, 4.0):
        cfg = config(workspace, workspace / "unused", far_weight=weight)
        model, _ = prepare_stage(build_student(cfg, None), cfg, 1)
        assert all(layer.far_weight == weight for layer in linearized_layers(model))
        with torch.no_grad():
            losses[weight] = stage_loss(model, ids, 1)
        model, _ = prepare_stage(build_student(cfg, None), cfg, 2)
        assert all(layer.far_weight == 0 for layer in linearized_layers(model))
    assert torch.isfinite(losses[4.0]) and losses[4.0] != losses[0.0]
    plain, far = config(workspace, workspace / "a"), config(workspace, workspace / "a", far_weight=4.0)
    assert far.same_run(plain) == ["far_weight"]


def test_head_scalars_get_their_own_stage1_learning_rate(workspace):
    from linearize.train.student import build_student, parameter_groups, prepare_stage

    cfg = config(workspace, workspace / "unused", head_lr_scale=30.0)
    model, _ = prepare_stage(build_student(cfg, None), cfg, 1)
    rest, scalars = parameter_groups(model, cfg, 1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)].rsplit(".", 1)[-1] for p in scalars["params"]} == {"alpha", "sinks", "bias"}
    assert all(names[id(p)].endswith(("alpha", "sinks", "gate.bias")) for p in scalars["params"])
    assert scalars["lr"] == 30 * rest["lr"] == 30 * cfg.lr_stage1
    trained = [p for p in model.parameters() if p.requires_grad]
    assert len(rest["params"]) + len(scalars["params"]) == len(trained)
    plain = parameter_groups(model, config(workspace, workspace / "unused"), 1)
    assert len(plain) == 1 and len(plain[0]["params"]) == len(trained)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_bf16_student_holds_frozen_weights_in_bf16_and_trains_float32_masters(workspace, tmp_path, stage):
    """Built for a bf16 run: the teacher's weights bf16, what the stage trains float32, stage 1's modules
    float32 in both stages (in stage 2, exactly the tensors stage 1 saved), RoPE's frequencies float32.
    Under autocast its loss is the float32 student's, to bf16 precision, and gradients reach the trained
    tensors only."""
    from linearize.train.losses import stage_loss
    from linearize.train.runtime import Runtime
    from linearize.train.student import build_student, linearized_layers, prepare_stage, weights_dtype

    # alpha at 1: a stage-1 loss well above zero (see test_both_stages_reduce_their_losses_and_export_a_model)
    cfg = config(workspace, tmp_path / "unused", options={"window": 8, "num_sinks": 2, "alpha_init": 1.0})
    rt = Runtime.start("cpu", "bf16")
    assert rt.bf16 and weights_dtype(rt, sharded=False) == torch.bfloat16
    assert weights_dtype(rt, sharded=True) == torch.float32
    stage1 = None
    if stage == 2:  # stage 1's modules moved off their init, saved in float32 as stage 1 saves them
        student = build_student(cfg, None)
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for layer in linearized_layers(student):
                for p in layer.new_parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=generator))
        stage1 = tmp_path / "stage1_attention.pt"
        torch.save({n: p.detach().clone() for n, p in student.named_parameters() if n in new_parameter_names(student)},
                   stage1)
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    losses = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model, names = prepare_stage(build_student(cfg, stage1, dtype=dtype), cfg, stage)
        model.train()
        new = new_parameter_names(model)
        params = dict(model.named_parameters())
        assert names and all(params[n].dtype == torch.float32 for n in names | new)
        frozen = {n: p.dtype for n, p in params.items() if n not in names | new}
        assert frozen and set(frozen.values()) == {dtype}, frozen
        assert {b.dtype for b in model.buffers()} == {torch.float32}
        if stage1 is not None:
            saved = torch.load(stage1)
            assert len(new) == len(saved)
            for name in new:
                assert torch.equal(params[name], saved[name.removeprefix("base_model.model.")]), name
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = stage_loss(model, ids, stage)
        loss.backward()
        assert {n for n, p in params.items() if p.grad is not None} == names
        assert all(params[n].grad.dtype == torch.float32 for n in names)
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=3e-2), losses


@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(workspace, stage):
    from linearize.train.losses import stage_loss
    from linearize.train.student import build_student, prepare_stage

    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    results = []
    for checkpointing in (False, True):
        cfg = config(workspace, workspace / "unused", gradient_checkpointing=checkpointing)
        torch.manual_seed(0)
        model, names = prepare_stage(build_student(cfg, None), cfg, stage)
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == checkpointing
        model.train()
        loss = stage_loss(model, ids, stage)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if n in names}
        results.append((loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], msg=name)


def test_softmax_by_error_reverts_the_worst_stage1_layer(workspace, tmp_path):
    out = distill(config(workspace, tmp_path / "run", softmax_by="error:1"), progress=False)
    record = json.loads((out / "stage1_layer_errors.json").read_text())
    errors = {int(k): v for k, v in record["mse"].items()}
    assert set(errors) == {0, 1} and all(v > 0 for v in errors.values())
    assert record["softmax_by"] == "error:1" and record["picked"] == [max(errors, key=errors.get)]
    model = load_model(out)
    assert model.config.linearize["softmax_layers"] == record["picked"]
    linear = [type(layer.self_attn).__name__ for layer in model.model.layers]
    assert linear.count("LizardAttention") == 1


def test_softmax_by_error_needs_stage_one(workspace, tmp_path):
    with pytest.raises(ValueError, match="needs both stages"):
        config(workspace, tmp_path / "run", softmax_by="error:1", stage="2")


def test_cuda_graph_on_the_cpu_trains_as_the_default_and_logs_why_it_stepped_eagerly(workspace, tmp_path):
    """`--cuda-graph` changes how a step is issued, not what it computes: on the CPU it steps eagerly,
    every record says so, and the run equals the default one (tests/train/test_step.py checks the
    graphed step against the eager loop on a GPU)."""
    plain = distill(config(workspace, tmp_path / "plain", stage="1"), progress=False)
    graphed = distill(config(workspace, tmp_path / "graphed", stage="1", cuda_graph=True), progress=False)
    steps = [r for r in log(graphed) if "loss" in r]
    assert {r["step_path"] for r in steps} == {"eager (parameters not on a CUDA device)"}
    assert [r["loss"] for r in steps] == [r["loss"] for r in log(plain) if "loss" in r]


@pytest.mark.slow
def test_sigterm_stops_a_distill_the_clean_way_and_a_rerun_resumes_it(workspace, tmp_path):
    """A scheduler's stop, `kill` or `docker stop` is a SIGTERM, which would kill the process between two
    checkpoints: the CLI raises it where Ctrl-C raises KeyboardInterrupt, so the run saves its checkpoint,
    says so and exits 143; rerunning with --resume finishes it."""
    out = tmp_path / "run"
    args = ["--model", str(workspace / "teacher"), "--data", str(workspace / "data.txt"), "--method", "lizard",
            "--out", str(out), "--max-tokens", str(4 * 32 * 8), "--seq-len", "32", "--batch", "4",
            "--save-every", "100", "--set", "window=8", "--set", "num_sinks=2"]
    # The process sends itself a real SIGTERM in its third stage-2 training step.
    script = (
        "import os, signal, sys\n"
        "from linearize.cli import main\n"
        "from linearize.train import stage_loop\n"
        "real, calls = stage_loop.stage_loss, [0]\n"
        "def loss(model, ids, stage):\n"
        "    calls[0] += stage == 2 and model.training\n"
        "    if calls[0] == 3:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(model, ids, stage)\n"
        "stage_loop.stage_loss = loss\n"
        "sys.exit(main(['distill', *sys.argv[1:]]))\n"
    )
    stopped = subprocess.run([sys.executable, "-c", script, *args], check=False, capture_output=True, text=True,
                             timeout=600, cwd=ROOT)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert stopped.stderr.strip().endswith("linearize: terminated") and "Traceback" not in stopped.stderr
    assert "interrupted: checkpoint at step" in stopped.stdout and (out / "checkpoint").is_dir()
    assert not (out / "config.json").exists()
    resumed = subprocess.run([sys.executable, "-m", "linearize.cli", "distill", *args, "--resume"], check=False,
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (out / "config.json").exists()
    stage2 = [r["step"] for r in log(out) if r.get("stage") == 2 and "loss" in r]
    assert stage2 == sorted(set(stage2))  # the resumed steps carry on from the checkpoint, none twice


def test_a_diverging_first_stage_is_one_error_and_leaves_no_run(workspace, tmp_path):
    """An lr that blows the weights up stops the run at the first non-finite loss, naming the flag; a run
    that never reached a checkpoint holds nothing a corrected command could resume, so it is removed."""
    from linearize.train import TrainingDiverged

    with pytest.raises(TrainingDiverged) as error:
        distill(config(workspace, tmp_path / "run", stage="1", lr_stage1=1e20), progress=False)
    message = str(error.value)
    assert "\n" not in message
    assert re.fullmatch(r"stage 1 diverged at step \d+: the (training|validation) loss is (inf|nan); "
                        r"a lower --lr \(stage 1's is 1e\+20\) keeps it finite", message), message
    assert not (tmp_path / "run").exists()


def test_a_diverging_second_stage_keeps_the_first_and_exports_nothing(workspace, tmp_path):
    from linearize.train import TrainingDiverged

    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match="^stage 2 diverged at step"):
        distill(config(workspace, out, lr_stage2=1e20), progress=False)
    assert (out / distill_module.STAGE1_NAME).exists()
    assert not (out / "config.json").exists()  # the export: no model of non-finite weights
    assert not (out / "stage2_lora.pt").exists()
    # The last checkpoint is the finished first stage's: the second diverged before its first save.
    saved = checkpoint.load(out / run_dir.CHECKPOINT_NAME)
    assert (saved["stage"], saved["stage_done"]) == (1, True)


def test_a_teacher_with_non_finite_outputs_is_refused_before_training(workspace, tmp_path):
    from safetensors.torch import load_file, save_file

    from linearize.train import TrainingDiverged

    broken = tmp_path / "teacher"
    shutil.copytree(workspace / "teacher", broken)
    weights = load_file(broken / "model.safetensors")
    name = next(k for k in weights if "o_proj" in k)
    weights[name][0, 0] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TrainingDiverged, match=r"^stage 1: the validation loss is nan before any training, .*"
                                               r"check the weights of .*teacher, or try --precision fp32$"):
        distill(config(workspace, tmp_path / "run", model=str(broken), stage="1"), progress=False)
    assert not (tmp_path / "run").exists()


def test_the_command_reports_a_divergence_as_one_error_line_with_exit_2(workspace, tmp_path, capsys):
    from linearize.cli import main

    code = main(["distill", "--model", str(workspace / "teacher"), "--method", "lizard", "--data",
                 str(workspace / "data.txt"), "--out", str(tmp_path / "run"), "--stage", "1", "--max-tokens", "256",
                 "--seq-len", "32", "--batch", "4", "--lr", "1e20"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2
    assert re.match(r"linearize: error: stage 1 diverged at step \d+: .* a lower --lr", lines[-1]), lines[-1]
    assert not any("Traceback" in line or "Warning" in line for line in lines), lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("calls", [1, 2])
def test_a_run_interrupted_before_its_first_step_leaves_no_folder_and_reruns_without_resume(workspace, tmp_path,
                                                                                            monkeypatch, calls):
    """Ctrl-C in the step-0 validation (the first call of the loss) or in the first training step: nothing to
    resume, so nothing is kept (no lone distill_config.json that would make a rerun demand --resume)."""
    real, seen = stage_loop.stage_loss, {"n": 0}

    def interrupted(model, ids, stage):
        seen["n"] += 1
        if seen["n"] == calls:
            raise KeyboardInterrupt
        return real(model, ids, stage)

    out = tmp_path / "run"
    monkeypatch.setattr(stage_loop, "stage_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill(config(workspace, out, stage="1"), progress=False)
    assert not out.exists()
    monkeypatch.setattr(stage_loop, "stage_loss", real)
    assert (distill(config(workspace, out, stage="1"), progress=False) / "config.json").is_file()
