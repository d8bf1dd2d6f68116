"""`linearize bench train` over modes, sequence lengths and gradient checkpointing, on the CPU at tiny sizes:
every point runs, an OOM is a row, the Markdown projects the recipe's GPU-hours, the shapes build as promised."""

import functools
import json
from pathlib import Path

import pytest
import torch

from linearize.bench import shapes
from linearize.bench import train as train_bench
from linearize.bench.command import register
from linearize.cli import _Parser
from linearize.train import DistillConfig
from linearize.train.runtime import Runtime

# A shape's code path at a size the CPU steps in milliseconds.
TINY_SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256}
SWEEP = ["--quick", "--seq-lens", "16,32", "--tokens-per-step", "32", "--steps", "1", "--gradient-checkpointing", "both"]
MODES = ["full", "lora", "stage1", "stage2"]


def run(*argv):
    parser = _Parser(prog="linearize")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    args.func(args)


def load(out):
    assert {p.name for p in out.iterdir()} >= {"train.json", "train.md", "train.png"}
    return json.loads((out / "train.json").read_text())


def recording_loss(monkeypatch):
    """bench.train's stage_loss, noting each call's (batch, length, checkpointing on)."""
    calls, real = [], train_bench.stage_loss

    def loss(model, ids, stage):
        on = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        calls.append((*ids.shape, on))
        return real(model, ids, stage)

    monkeypatch.setattr(train_bench, "stage_loss", loss)
    return calls


@pytest.mark.slow
def test_every_mode_runs_at_every_length_with_and_without_checkpointing(teacher_dir, tmp_path, monkeypatch):
    calls = recording_loss(monkeypatch)
    run("bench", "train", "--out", tmp_path, "--model", teacher_dir, *SWEEP, "--set", "window=8")
    results = load(tmp_path)
    rows = results["rows"]
    assert [(r["key"], r["gradient_checkpointing"], r["seq_len"]) for r in rows] == [
        (mode, on, n) for mode in MODES for on in (False, True) for n in (16, 32)]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows)
    assert {(r["seq_len"], r["batch"]) for r in rows} == {(16, 2), (32, 1)}  # 32 tokens a step at each length
    # Each point stepped at its batch and length, with checkpointing as its row says (warm-up and timed steps).
    assert sorted(set(calls)) == sorted({(r["batch"], r["seq_len"], r["gradient_checkpointing"]) for r in rows})
    assert all(r["peak_bytes"] is None and r["fits_80gb"] is None for r in rows)  # no memory figures off CUDA
    settings = results["settings"]
    assert settings["modes"] == MODES and settings["seq_lens"] == [16, 32] and settings["tokens_per_step"] == 32
    assert settings["lora"] == {"r": 8, "alpha": 16, "targets": ["q_proj", "k_proj", "v_proj"]}
    assert settings["recipe_tokens"] == 20_000_000

    md = (tmp_path / "train.md").read_text()
    assert ("| mode | seq len × batch | checkpointing | trained parameters | tokens/s | vs the full fine-tune | "
            "vs the LoRA fine-tune | ms per step | peak GiB | fits 80 GB |") in md
    assert "| stage 2 (LoRA) | 32 × 1 | on |" in md
    assert "**Projection: the papers' recipe, 20M tokens a stage (40M in all) on one GPU.**" in md
    projection = [line for line in md.splitlines() if line.startswith(("| 16 | this device", "| 32 | this device"))]
    assert len(projection) == 2 and all(line.count("checkpointing o") == 3 for line in projection)


@pytest.mark.slow
def test_a_shape_builds_random_weights_and_sweeps_the_same_points(tmp_path, monkeypatch):
    """`--shape smollm2` on the CPU (its layers and widths cut down here): the shape's defaults, every mode."""
    monkeypatch.setattr(train_bench, "random_model", functools.partial(shapes.random_model, **TINY_SHAPE))
    run("bench", "train", "--out", tmp_path, "--shape", "smollm2", "--quick", "--steps", "1")
    results = load(tmp_path)
    settings = results["settings"]
    assert settings["shape"] == "smollm2" and settings["model"] is None and settings["weights"] == "float32"
    assert results["title"].startswith("Training throughput: smollm2 shape, random weights, lizard")
    # A shape's quick defaults: two lengths, checkpointing off and on, every mode (a full fine-tune fits).
    assert [(r["key"], r["gradient_checkpointing"], r["seq_len"], r["batch"]) for r in results["rows"]] == [
        (mode, on, n, 128 // n) for mode in MODES for on in (False, True) for n in (32, 64)]
    assert all(r["status"] == "ok" for r in results["rows"])


def test_the_8b_shapes_leave_the_full_fine_tune_out_and_sweep_2k_and_8k():
    for shape in ("llama3-8b", "mistral-7b", "qwen3-8b"):
        assert train_bench.default_modes(None, shape) == ["lora", "stage1", "stage2"]
        settings = train_bench.point_settings(None, shape, False, {})
        assert settings["seq_lens"] == [2048, 8192] and settings["checkpointing"] == "both"
        assert [train_bench.batch_of(settings, n) for n in settings["seq_lens"]] == [8, 2]
    assert train_bench.default_modes("smollm2", None) == train_bench.default_modes(None, "smollm2") == MODES
    assert train_bench.default_modes("smollm2", None, "liger") == ["full", "lora", "stage2"]  # no stage 1 to train
    assert train_bench.point_settings("smollm2", None, False, {})["seq_lens"] == [2048]
    fixed = train_bench.point_settings(None, "llama3-8b", False, {"batch": 4})
    assert fixed["tokens_per_step"] is None and train_bench.batch_of(fixed, 8192) == 4
    with pytest.raises(ValueError, match="not a multiple of the sequence length"):
        train_bench.point_settings(None, "llama3-8b", False, {"seq_lens": [3000]})


@pytest.mark.parametrize("name, parameters", [("llama3-8b", 8_030_261_248), ("mistral-7b", 7_241_732_096),
                                              ("qwen3-8b", 8_190_735_360)])
def test_shapes_have_the_published_models_sizes(name, parameters):
    """Built on the meta device: the sizes without the memory."""
    model = shapes.random_model(name, device="meta", dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    attention = model.model.layers[0].self_attn
    assert hasattr(attention, "q_norm") == (name == "qwen3-8b")
    assert model.config._attn_implementation == "sdpa"
    assert getattr(model.config, "sliding_window", None) is None


@pytest.mark.parametrize("mode", MODES)
def test_a_shape_holds_frozen_weights_once_in_bf16_and_trains_float32_masters(mode):
    """At a shape, only what AdamW steps is float32; every frozen tensor stays in the build dtype (bf16 on
    a GPU). Stage 2 keeps stage 1's new modules float32, as the trainer has them."""
    settings = {"model": None, "shape": "smollm2", "shape_overrides": TINY_SHAPE}
    cfg = DistillConfig(model="smollm2", method="lizard", out="unused", options={"window": 8})
    rt = Runtime(rank=0, world_size=1, device=torch.device("cpu"), bf16=False)
    model, params = train_bench.build(settings, cfg, mode, rt, torch.bfloat16)
    trained = {id(p) for p in params}
    assert trained and all(p.dtype == torch.float32 for p in params)
    new = {id(p) for layer in train_bench.linearized_layers(model) for p in layer.new_parameters()}
    frozen = [(n, p.dtype) for n, p in model.named_parameters() if id(p) not in trained | new]
    assert all(dtype == torch.bfloat16 for _, dtype in frozen), frozen
    assert bool(frozen) == (mode != "full") and bool(new) == (mode in ("stage1", "stage2"))
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if id(p) in new)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_a_loaded_teacher_is_built_as_the_trainer_builds_it(teacher_dir, mode, bf16):
    """`--model` under bf16 autocast (on the CPU here): the teacher loaded in bf16, only what AdamW steps
    float32, stage 1's new modules float32 in stage 2 too, buffers float32; without it, all float32."""
    settings = {"model": str(teacher_dir), "shape": None}
    cfg = DistillConfig(model=str(teacher_dir), method="lizard", out="unused", options={"window": 8})
    rt = Runtime(rank=0, world_size=1, device=torch.device("cpu"), bf16=bf16)
    model, params = train_bench.build(settings, cfg, mode, rt, torch.float32)
    trained = {id(p) for p in params}
    assert trained and all(p.dtype == torch.float32 for p in params)
    new = {id(p) for layer in train_bench.linearized_layers(model) for p in layer.new_parameters()}
    assert bool(new) == (mode in ("stage1", "stage2")) and all(p.dtype == torch.float32 for p in model.parameters()
                                                              if id(p) in new)
    frozen = {p.dtype for p in model.parameters() if id(p) not in trained | new}
    assert frozen == (set() if mode == "full" else {torch.bfloat16 if bf16 else torch.float32})
    assert {b.dtype for b in model.buffers()} == {torch.float32}


class OutOfMemoryAt32(train_bench.TrainStep):
    """A step that runs out of memory on batches of 32-token sequences."""

    def __call__(self, micro_batches):
        if micro_batches[0].shape[1] == 32:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().__call__(micro_batches)


@pytest.mark.slow
def test_an_oom_is_a_row_and_the_other_points_run(teacher_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(train_bench, "TrainStep", OutOfMemoryAt32)
    run("bench", "train", "--out", tmp_path, "--model", teacher_dir, *SWEEP, "--modes", "stage1,stage2")
    rows = load(tmp_path)["rows"]
    assert [(r["seq_len"], r["status"]) for r in rows] == [(16, "ok"), (32, "oom")] * 4
    md = (tmp_path / "train.md").read_text()
    assert "| stage 1 (attention transfer) | 32 × 1 | off | 2,608 | OOM |" in md
    assert "| 16 | this device (" in md
    assert any(line.startswith("| 32 | this device (") and line.endswith("| OOM | OOM | – |") for line in md.splitlines())


def test_a_point_past_the_time_limit_is_skipped(teacher_dir, tmp_path):
    train_bench.bench(tmp_path, model=str(teacher_dir), quick=True, modes=["stage1", "stage2"], time_limit=1e-3,
                      options={"window": 8})
    rows = json.loads((tmp_path / "train.json").read_text())["rows"]
    assert rows[0]["status"] == "ok"  # the first point has nothing to estimate from
    assert [r["status"] for r in rows[1:]] == ["skipped"] and rows[1]["reason"] == "would pass the time limit"


def _row(mode, seq_len, checkpointing, tokens_per_s, peak_gib, status="ok"):
    label, stage = train_bench.MODES[mode]
    return {"mode": label, "key": mode, "stage": stage, "seq_len": seq_len, "batch": 16384 // seq_len,
            "gradient_checkpointing": checkpointing, "status": status, "tokens_per_s": tokens_per_s,
            "step_ms": 16384e3 / tokens_per_s if tokens_per_s else None, "trained_parameters": 1000,
            "peak_bytes": None if peak_gib is None else int(peak_gib * 2**30)}


def test_the_projection_is_the_recipes_tokens_over_the_fastest_points():
    """Hours = 20M / tokens/s / 3600 at each stage's fastest point: on this GPU, and among the points whose
    peak fits an 80 GB GPU."""
    rows = [_row("stage1", 2048, False, 10_000, 90), _row("stage1", 2048, True, 8_000, 50),
            {**_row("stage2", 2048, False, None, None), "status": "oom"}, _row("stage2", 2048, True, 5_000, 70),
            _row("lora", 2048, True, 6_000, 78)]
    results = {"settings": {"tokens_per_step": 16384, "precision": "bf16 autocast", "steps": 6, "warmup": 2,
                            "seq_lens": [2048], "recipe_tokens": 20_000_000},
               "environment": {"device": "NVIDIA H200", "device_type": "cuda"}, "rows": rows}
    lines = train_bench.tables(results)
    assert ("| stage 1 (attention transfer) | 2K × 8 | off | 1,000 | 10,000 | – | 1,638 | 90.00 | no |"
            in lines)
    assert "| stage 1 (attention transfer) | 2K × 8 | on | 1,000 | 8,000 | 1.33x | 2,048 | 50.00 | yes |" in lines
    assert "| stage 2 (LoRA) | 2K × 8 | off | 1,000 | OOM | OOM | OOM | OOM | OOM |" in lines  # trained params known
    assert ("| 2K | this GPU (NVIDIA H200) | 0.6 (checkpointing off, 10,000 tokens/s) | 1.1 (checkpointing on, "
            "5,000 tokens/s) | 0.9 (checkpointing on, 6,000 tokens/s) | 1.7 |") in lines
    assert ("| 2K | 80 GB | 0.7 (checkpointing on, 8,000 tokens/s) | 1.1 (checkpointing on, 5,000 tokens/s) | "
            "does not fit | 1.8 |") in lines


def test_runs_from_before_the_sweep_still_render():
    """docs/results hold train.json files of one length, no checkpointing and no mode keys."""
    old = json.loads((Path(__file__).parents[2] / "docs/results/h200/train-graph-23/recipe/train/train.json")
                     .read_text())
    lines = train_bench.tables(old)
    assert any(line.startswith("| full fine-tune (teacher) | 2K × 8 | off | 134,515,008 | 143,388 | 1.00x |")
               for line in lines)
    assert any(line.startswith("| 2K | this GPU (NVIDIA H200) |") for line in lines)


def refused_in_one_line(capsys, out: Path, *argv, names: str) -> None:
    """`bench train ... --out out` exits 2 with one line naming `names`, and writes no `out`."""
    from linearize.cli import main

    assert main(["bench", "train", *map(str, argv), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert names in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_an_8b_shape_on_a_cpu_is_refused_in_one_line(tmp_path, capsys):
    refused_in_one_line(capsys, tmp_path / "out", "--shape", "llama3-8b", "--quick", names="needs a GPU")


def test_tokens_per_step_that_a_length_does_not_divide_is_refused_in_one_line(teacher_dir, tmp_path, capsys):
    refused_in_one_line(capsys, tmp_path / "out", "--model", teacher_dir, "--quick", "--seq-lens", "48",
                        "--tokens-per-step", "64", names="not a multiple of the sequence length")


def test_release_step_drops_what_a_cut_short_step_left_on_the_model():
    """A stage-1 forward that an OOM cut short leaves each layer's loss, and through its graph the layer's
    activations, on the model: the next point must not start with them."""
    settings = {"model": None, "shape": "smollm2", "shape_overrides": TINY_SHAPE}
    cfg = DistillConfig(model="smollm2", method="lizard", out="unused", options={"window": 8})
    rt = Runtime(rank=0, world_size=1, device=torch.device("cpu"), bf16=False)
    model, params = train_bench.build(settings, cfg, "stage1", rt, torch.float32)
    train_bench.stage_loss(model, torch.randint(256, (1, 16)), 1)
    layers = train_bench.linearized_layers(model)
    assert all(layer.transfer_loss is not None and layer.transfer_loss.grad_fn is not None for layer in layers)
    train_bench.release_step(model, params)
    assert all(layer.transfer_loss is None and layer.rotated is None for layer in layers)


def test_liger_times_stage_2_and_refuses_stage_1_in_one_line(teacher_dir, tmp_path, capsys):
    run("bench", "train", "--out", tmp_path / "liger", "--model", teacher_dir, "--method", "liger", "--quick",
        "--steps", "1", "--modes", "stage2", "--set", "window=8")
    assert [r["status"] for r in load(tmp_path / "liger")["rows"]] == ["ok"]
    capsys.readouterr()  # the run's own lines, before the refusal's
    refused_in_one_line(capsys, tmp_path / "out", "--model", teacher_dir, "--method", "liger", "--quick", "--modes",
                        "stage1,stage2", names="liger adds no parameters for stage 1")
