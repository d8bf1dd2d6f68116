"""`linearize bench` on CPU with --quick: every subcommand writes json/md/png; GPU-only rows are skipped cleanly."""

import asyncio
import json
import signal
from types import SimpleNamespace

import pytest
import torch

from linearize.bench import kernels as kernels_bench
from linearize.bench import model as model_bench
from linearize.bench.command import register
from linearize.bench.common import OpCount, new_results, parse_sizes
from linearize.bench.report import main as report_main
from linearize.bench.report import title
from linearize.cli import _Parser


def run(*argv):
    parser = _Parser(prog="linearize")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    args.func(args)


def load(out, name):
    assert {p.name for p in out.iterdir()} >= {f"{name}.json", f"{name}.md"}
    assert list(out.glob("*.png"))
    return json.loads((out / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, teacher_dir):
    root = tmp_path_factory.mktemp("runs")
    run("bench", "kernels", "--out", root / "kernels", "--quick")
    run("bench", "model", "--out", root / "model", "--model", teacher_dir, "--quick", "--set", "combine=shared",
        "--profile", "--compile-decode", "aot_eager")
    run("bench", "train", "--out", root / "train", "--model", teacher_dir, "--quick", "--profile", "--cuda-graph",
        "--set", "combine=shared", "--set", "rope_in_window=true")
    run("bench", "serve", "--out", root / "serve", "--model", teacher_dir, "--quick", "--set", "window=8")
    return root


@pytest.mark.slow
def test_kernels_measure_our_op_and_sdpa_and_skip_gpu_only_rows(outputs):
    results = load(outputs / "kernels", "kernels")
    assert results["peak"]["tflops"] > 0
    by_op = {}
    for row in results["rows"]:
        by_op.setdefault(row["op"], set()).add(row["status"])
        if row["status"] == "ok":
            assert row["ms"] > 0 and row["tflops"] > 0 and row["flops"] > 0
    assert by_op["lizard (pytorch chunked)"] == {"ok"}
    assert by_op["sdpa causal"] == {"ok"}
    if not torch.cuda.is_available():
        assert by_op["fla chunk_gla"] == by_op["fla chunk_simple_gla"] == by_op["lizard (triton)"] == {"skipped"}
    assert set(results["flop_formulas"]) == set(by_op)
    md = (outputs / "kernels" / "kernels.md").read_text()
    assert "| lizard (pytorch chunked) | fwd+bwd |" in md


def test_kernels_ops_times_only_those_and_names_its_section(tmp_path):
    run("bench", "kernels", "--out", tmp_path, "--quick", "--ops", "sdpa")
    results = load(tmp_path, "kernels")
    assert {row["op"] for row in results["rows"]} == {"sdpa causal"}
    assert results["settings"]["ops"] == ["sdpa"] and title(results).endswith("(ops sdpa)")
    assert "lizard_config" not in results["settings"]
    assert "lizard (triton) ran" not in (tmp_path / "kernels.md").read_text()
    with pytest.raises(ValueError, match="unknown op.*flash.*choose from triton"):
        run("bench", "kernels", "--out", tmp_path, "--quick", "--ops", "sdpa,flash")


def _kernel_row(op, mode, L, ms):
    return {"op": op, "mode": mode, "B": 16, "H": 32, "L": L, "D": 128, "status": "ok", "ms": ms}


def test_kernel_targets_are_ratios_to_fla_in_the_same_run_or_another(tmp_path, capsys):
    ours = [_kernel_row("lizard (triton)", "fwd", 2048, 1.3), _kernel_row("lizard (triton)", "fwd", 8192, 4.5),
            _kernel_row("lizard (triton)", "fwd+bwd", 2048, 5.0)]
    fla = [_kernel_row("fla chunk_gla", "fwd", 2048, 2.8), _kernel_row("fla chunk_gla", "fwd", 8192, 10.0),
           _kernel_row("fla chunk_simple_gla", "fwd", 2048, 1.0), _kernel_row("fla chunk_simple_gla", "fwd", 8192, 3.6),
           {**_kernel_row("fla chunk_gla", "fwd+bwd", 2048, 0.0), "status": "error"}]
    lines = kernels_bench.target_lines(ours, fla)
    assert lines[0] == ("- lizard (triton) fwd / fla chunk_gla: B=16 L=2K 0.46x, B=16 L=8K 0.45x "
                        "(target at most 0.5x: met)")
    assert lines[1] == ("- lizard (triton) fwd / fla chunk_simple_gla: B=16 L=2K 1.30x, B=16 L=8K 1.25x "
                        "(target at most 1.3x: met)")
    assert lines[2] == "" and len(lines) == 3  # fla's fwd+bwd failed: no ratio, no verdict
    slower = [{**row, "ms": row["ms"] * 1.1} for row in ours]
    assert "B=16 L=2K 1.43x" in kernels_bench.target_lines(slower, fla)[1]
    assert "missed" in kernels_bench.target_lines(slower, fla)[1]
    # Our op's times win over any of its rows in the other run; that run alone has no fla rows.
    assert kernels_bench.target_lines(ours, fla + slower) == lines
    assert kernels_bench.target_lines(ours, ours) == []
    (tmp_path / "ours.json").write_text(json.dumps({"rows": ours}))
    (tmp_path / "fla.json").write_text(json.dumps({"rows": fla}))
    kernels_bench.main([str(tmp_path / "ours.json"), str(tmp_path / "fla.json")])
    assert capsys.readouterr().out.splitlines() == lines[:2]


@pytest.mark.slow
def test_model_compares_softmax_with_lizard_and_the_linear_cache_stays_constant(outputs):
    results = load(outputs / "model", "model")
    assert [m["name"] for m in results["models"]] == [model_bench.SOFTMAX, "lizard"]
    assert results["models"][1]["linearize"]["options"]["combine"] == "shared"  # --set reached the model
    assert all(p["status"] == "ok" for p in results["points"])
    floor = [p for p in results["points"] if p["model"] == model_bench.FLOOR]
    points = [p for p in results["points"] if p["model"] != model_bench.FLOOR]
    # The floor at every context of the batch-1 sweep, in the calls a linear model prefills in.
    assert [(p["sweep"], p["batch"], p["context"]) for p in floor] == [
        ("context", 1, c) for c in results["settings"]["contexts"]]
    assert [p["prefill_calls"] for p in floor] == [
        -(-c // results["settings"]["prefill_chunk"]) for c in results["settings"]["contexts"]]
    assert all(p["prefill_ms"] > 0 for p in floor)
    markdown = (outputs / "model" / "model.md").read_text()
    assert f"**{model_bench.FLOOR}, batch 1** (ms)" in markdown and "x) |" in markdown
    context = {(p["model"], p["context"]): p for p in points if p["sweep"] == "context"}
    short, long = results["settings"]["contexts"]
    assert context["lizard", short]["cache_bytes"] == context["lizard", long]["cache_bytes"]
    assert context[model_bench.SOFTMAX, long]["cache_bytes"] > context[model_bench.SOFTMAX, short]["cache_bytes"]
    assert context["lizard", long]["prefill_calls"] == long // results["settings"]["prefill_chunk"] > 1
    assert context[model_bench.SOFTMAX, long]["prefill_calls"] == 1
    batch = [p for p in points if p["sweep"] == "batch"]
    assert {p["batch"] for p in batch} == set(results["settings"]["batches"])
    assert all(p["decode_tokens_per_s"] > 0 and p["prefill_ms"] > 0 for p in points)
    assert {p["decode_path"] for p in points if p["model"] == "lizard"} == {"eager, fused projections, compiled (aot_eager)"}
    if not torch.cuda.is_available():
        assert all(p["decode_peak_bytes"] is None for p in points)
    assert {p.name for p in (outputs / "model").glob("*.png")} == {
        f"model.{name}.png" for name in ("prefill", "decode", "memory", "batch")}


@pytest.mark.slow
def test_train_times_both_stages_and_the_teachers_fine_tunes(outputs):
    results = load(outputs / "train", "train")
    rows = {r["key"]: r for r in results["rows"]}
    assert list(rows) == ["full", "lora", "stage1", "stage2"] and len(results["rows"]) == 4  # one point each
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows.values())
    assert [r["stage"] for r in rows.values()] == [None, None, 1, 2]
    full = rows.pop("full")["trained_parameters"]
    assert all(0 < r["trained_parameters"] < full for r in rows.values())
    assert rows["lora"]["trained_parameters"] == rows["stage2"]["trained_parameters"]  # the same adapters
    assert {(r["seq_len"], r["batch"], r["gradient_checkpointing"]) for r in rows.values()} == {(64, 2, False)}
    assert results["settings"]["attention"] == "PyTorch ops"  # no GPU here: what the record must say
    assert results["settings"]["options"] == {"combine": "shared", "rope_in_window": "true"}
    # --cuda-graph on the CPU: every mode stepped eagerly, and its row and the table say why
    assert {r["step_path"] for r in rows.values()} == {"eager (parameters not on a CUDA device)"}
    assert "- stage 2 (LoRA), 64: step eager (parameters not on a CUDA device)" in (outputs / "train" / "train.md").read_text()


@pytest.mark.slow
def test_train_profile_lists_each_points_top_ops(outputs):
    for mode in ("full", "lora", "stage1", "stage2"):
        table = (outputs / "train" / f"profile-{mode}-64.txt").read_text()
        assert "Self CPU" in table and "aten::mm" in table, mode


def test_the_gemm_floor_does_the_projections_and_mlp_flops_and_nothing_else(teacher_dir):
    """Every matmul FLOP of the floor is a projection's or an MLP's, at every layer and token, in
    calls of the linear models' chunk: 2 x tokens x their weights, per timed repeat. The fusing it
    times them under is undone after: the teacher's weights are its own again, equal and unshared."""
    from torch.utils.flop_counter import FlopCounterMode

    from linearize.fused_projections import projections_fused
    from linearize.loading import load_model

    model = load_model(str(teacher_dir), dtype=torch.float32)
    layers = model.get_decoder().layers
    weights = sum(m.weight.numel() for layer in layers for part in (layer.self_attn, layer.mlp)
                  for m in part.modules() if isinstance(m, torch.nn.Linear))
    settings = dict(model_bench.QUICK)
    context, chunk = 3 * settings["prefill_chunk"] + 5, settings["prefill_chunk"]
    with torch.inference_mode(), FlopCounterMode(display=False) as flops:
        point = model_bench.gemm_floor_point(model, batch=1, context=context, chunk=chunk, settings=settings,
                                             device=torch.device("cpu"))
    assert point["prefill_calls"] == 4 and point["prefill_repeats"] == 1 and point["prefill_ms"] > 0
    assert flops.get_total_flops() == 2 * context * weights
    assert not projections_fused(model) and type(layers[0].mlp).__name__ == "LlamaMLP"
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == len(list(model.parameters()))
    reloaded = load_model(str(teacher_dir), dtype=torch.float32).state_dict()
    assert all(torch.equal(value, reloaded[name]) for name, value in model.state_dict().items())


@pytest.mark.slow
def test_model_profile_lists_each_models_top_ops_in_prefill_and_decode(outputs):
    for name in ("softmax", "lizard"):
        for phase in ("prefill", "decode"):
            table = (outputs / "model" / f"profile-{name}-{phase}.txt").read_text()
            assert "Self CPU" in table and "aten::mm" in table, (name, phase)


def test_profile_prefill_stays_within_the_sweep_and_continues_a_linear_cache():
    settings = dict(model_bench.FULL, prefill_chunk=128 * 1024, contexts=[4096, 32768])
    assert model_bench.profile_point("still", settings) == (32768, 16384)  # not 256K: STILL's is quadratic
    assert model_bench.profile_point(model_bench.SOFTMAX, settings) == (32768, 32768)
    settings.update(contexts=parse_sizes("1k,1m"), prefill_chunk=16384)
    assert model_bench.profile_point("lizard", settings) == (32768, 16384)
    settings.update(teacher_max=8192)
    assert model_bench.profile_point(model_bench.SOFTMAX, settings) == (8192, 8192)


def test_op_count_counts_dispatched_ops_and_views_apart():
    x = torch.ones(4, 3)
    with OpCount() as count:
        x.view(3, 4).t().add(1).sum()
    assert (count.ops, count.views) == (4, 2)


@pytest.mark.slow
def test_report_merges_sections_and_replaces_them_on_rerun(outputs, tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nHow to rerun.\n")
    dirs = [outputs / name for name in ("kernels", "model", "train", "serve")]
    assert report_main([*map(str, dirs), "--doc", str(doc)]) == 0
    first = doc.read_text()
    assert first.startswith("# Benchmarks\n\nHow to rerun.\n")
    for name in ("kernels", "model", "train", "serve"):
        results = json.loads((outputs / name / f"{name}.json").read_text())
        assert f"### {results['title']}" in first
        if name == "model":  # its run had --set options: they name its section, so other options get another
            assert f"### {results['title']} (combine=shared, decode compiled (aot_eager))\n" in first
        if name == "train":
            assert f"### {results['title']} (combine=shared, rope_in_window=true, cuda graph)\n" in first
        assert results["command"] in first
    assert report_main([*map(str, dirs), "--doc", str(doc)]) == 0
    assert doc.read_text() == first


def test_code_path_switches_name_the_section_and_lead_the_command(monkeypatch):
    """A run on the PyTorch backend (LINEARIZE_BACKEND=torch) measures other code: its section must not
    replace the default run's, and its command must rerun it. LINEARIZE_CACHE (where assets live) changes
    neither."""
    monkeypatch.setenv("LINEARIZE_BACKEND", "torch")
    monkeypatch.setenv("LINEARIZE_CACHE", "/somewhere")
    results = new_results("train", "Training throughput", torch.device("cpu"), {"options": {"combine": "shared"}})
    assert results["environment"]["switches"] == {"LINEARIZE_BACKEND": "torch"}
    assert results["command"].startswith("LINEARIZE_BACKEND=torch ") and "/somewhere" not in results["command"]
    assert title(results).endswith("(combine=shared, LINEARIZE_BACKEND=torch)")
    monkeypatch.delenv("LINEARIZE_BACKEND")
    plain = new_results("train", "Training throughput", torch.device("cpu"), {})
    assert plain["environment"]["switches"] == {} and title(plain) == plain["title"]
    from linearize.ops.backend import use_backend

    with use_backend("torch"):  # set in code rather than in the environment: the same section and command
        chosen = new_results("train", "Training throughput", torch.device("cpu"), {})
    assert chosen["environment"]["switches"] == {"LINEARIZE_BACKEND": "torch"}


def test_a_model_run_of_other_methods_is_another_section():
    """A STILL-only `bench model` must not replace the default (Lizard) run's section."""
    default = new_results("model", "Model speed", torch.device("cpu"), {"methods": ["lizard"]})
    still = new_results("model", "Model speed", torch.device("cpu"), {"methods": ["still"]})
    both = new_results("model", "Model speed", torch.device("cpu"), {"methods": ["lizard", "still"]})
    assert title(default) == default["title"]
    assert title(still).endswith("(methods still)") and title(both).endswith("(methods lizard+still)")


def test_a_paced_serve_run_is_another_section():
    """`bench serve --prefill-budget 1` must not replace the whole-chunk run's section."""
    whole = new_results("serve", "Serving", torch.device("cpu"), {"prefill_budget": 0.0})
    paced = new_results("serve", "Serving", torch.device("cpu"), {"prefill_budget": 1.0})
    assert title(whole) == whole["title"] and title(paced).endswith("(prefill budget 1)")


@pytest.mark.slow
def test_a_sweep_stops_at_the_first_oom_and_at_the_time_limit(teacher_dir, tmp_path, monkeypatch):
    measure = model_bench.measure_point

    def out_of_memory_from_128(model, *, batch, context, **kwargs):
        if batch * context >= 128:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return measure(model, batch=batch, context=context, **kwargs)

    monkeypatch.setattr(model_bench, "measure_point", out_of_memory_from_128)
    model_bench.bench(tmp_path / "oom", model=str(teacher_dir), methods=["lizard"], quick=True,
                      contexts=[64, 128, 256], batches=[1])
    points = json.loads((tmp_path / "oom" / "model.json").read_text())["points"]
    statuses = [p["status"] for p in points if p["sweep"] == "context" and p["model"] != model_bench.FLOOR]
    assert statuses == ["ok", "oom", "skipped"] * 2
    assert [p["status"] for p in points if p["model"] == model_bench.FLOOR] == ["ok"] * 3  # a sweep of its own

    monkeypatch.setattr(model_bench, "measure_point", measure)
    model_bench.bench(tmp_path / "late", model=str(teacher_dir), methods=["lizard"], quick=True, time_limit=1e-3)
    points = json.loads((tmp_path / "late" / "model.json").read_text())["points"]
    skipped = [p for p in points if p["status"] == "skipped"]
    assert skipped and all(p["reason"] == "would pass the time limit" for p in skipped)


@pytest.mark.parametrize("argv", [
    ["model", "--contexts", "1x"],
    ["model", "--methods", "mamba"],
    ["model", "--shape", "smollm2", "--model", "smollm2"],
    ["train", "--steps", "0"],
    ["train", "--shape", "smollm2", "--model", "smollm2"],
    ["train", "--shape", "gpt5"],
    ["train", "--modes", "stage1,stage3"],
    ["train", "--seq-lens", "2k,x"],
    ["train", "--seq-len", "2k", "--seq-lens", "2k,8k"],
    ["train", "--batch", "2", "--tokens-per-step", "16k"],
    ["train", "--gradient-checkpointing", "sometimes"],
    ["train", "--time-limit", "0"],
    ["serve", "--clients", "0"],
    ["serve", "--methods", "mamba"],
    ["serve", "--max-tokens", "-1"],
])
def test_bad_flags_fail_with_one_line(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run("bench", argv[0], "--out", tmp_path / "out", *argv[1:])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_parse_sizes():
    assert parse_sizes("1k, 4K,1m,512") == [1024, 4096, 1 << 20, 512]
    for bad in ("", "k", "0", "1.5k", "-1"):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_model_with_full_layers_only_keeps_a_constant_cache_beside_the_sliding_layers(tmp_path):
    """`--layers full` on a teacher with sliding layers: its softmax sliding layers keep their window and
    the linearized full layer its state, so the cache is the same size at every context; it steps as HF
    does (the static decoder takes fully linearized models only)."""
    from tiny_models import save_tiny_teacher

    teacher = save_tiny_teacher(tmp_path / "gemma", arch="gemma3_text")
    model_bench.bench(tmp_path / "out", model=str(teacher), methods=["lizard"], quick=True, layers="full",
                      contexts=[64, 256], batches=[1], options={"window": 8})
    results = json.loads((tmp_path / "out" / "model.json").read_text())
    assert results["models"][1]["linearize"]["softmax_layers"] == [0, 1]
    lizard = {p["context"]: p for p in results["points"] if p["model"] == "lizard" and p["sweep"] == "context"}
    assert lizard[64]["status"] == lizard[256]["status"] == "ok"
    assert lizard[64]["cache_bytes"] == lizard[256]["cache_bytes"] > 0
    assert lizard[256]["decode_path"] == "eager"


def test_serve_measures_the_engine_for_softmax_and_lizard(teacher_dir, tmp_path):
    """`bench serve --quick`: every point ran, each request got all its tokens, the linearized model
    served from slots and the teacher from batched KV rows; the Markdown holds both tables."""
    from linearize.bench import serve as serve_bench

    serve_bench.bench(tmp_path / "serve", model=str(teacher_dir), methods=["lizard"], quick=True,
                      options={"window": 8})
    results = json.loads((tmp_path / "serve" / "serve.json").read_text())
    settings = results["settings"]
    points = results["points"]
    assert len(points) == 2 * len(settings["clients"]) * len(settings["prompt_lengths"])
    for p in points:
        assert p["status"] == "ok", p
        assert p["output_tokens"] == p["clients"] * settings["max_tokens"]
        assert p["output_tokens_per_s"] > 0 and p["ttft_p99_ms"] >= p["ttft_p50_ms"] > 0
        assert p["mode"] == ("kv" if p["model"] == model_bench.SOFTMAX else "slots")
        assert 0 < p["all_prefilled_s"] <= p["wall_s"]
        assert p["decode_tokens_per_s"] is None or p["decode_tokens_per_s"] > 0
        # Whole chunks (the quick settings' 16 tokens, no budget): every prompt in ceil(length / 16) calls.
        assert p["prefilled_tokens"] == p["clients"] * p["prompt_length"]
        assert p["prefill_calls"] == p["clients"] * -(-p["prompt_length"] // settings["prefill_chunk"])
    markdown = (tmp_path / "serve" / "serve.md").read_text()
    assert "Output tokens/s" in markdown and "batched KV" in markdown and "slots; prompts in" in markdown
    assert "decode tokens/s" in markdown


@pytest.mark.slow
def test_serve_skips_a_point_whose_time_grows_with_its_clients_past_the_limit(tmp_path, monkeypatch):
    """A point's time is estimated in proportion to its clients from the last one measured: at 4x the
    clients, a point a third of the first model's share (half the limit) long predicts 4/3 of it, and
    is skipped; the second model gets the time the first left, all of it here, and runs both."""
    from linearize.bench import serve as serve_bench

    time_limit = 60.0
    measured = []

    def fake_point(net, *, clients, prompt_length, settings, device, deadline):
        measured.append((clients, prompt_length))
        # A sixth of the time limit, whatever the clients, and at once.
        return {"status": "ok", "mode": "slots", "slots": clients, "peak_running": clients, "kv_budget_bytes": None,
                "wall_s": time_limit / 6, "output_tokens": clients, "output_tokens_per_s": 1.0, "all_prefilled_s": 1.0,
                "decode_tokens_per_s": None, "ttft_p50_ms": 1.0, "ttft_p99_ms": 1.0, "itl_p50_ms": None,
                "itl_p99_ms": None, "peak_bytes": None}

    monkeypatch.setattr(serve_bench, "measure_point", fake_point)
    monkeypatch.setattr(serve_bench, "build", lambda settings, variant, device, dtype: SimpleNamespace(config=None))
    serve_bench.bench(tmp_path / "serve", quick=True, clients=[1, 4], time_limit=time_limit)
    points = json.loads((tmp_path / "serve" / "serve.json").read_text())["points"]
    # Each model's warm-up first (the fewest clients, the prompt cut to one prefill chunk), then its points.
    assert measured == [(1, 16), (1, 32), (1, 16), (1, 32), (4, 32)]
    assert [p["status"] for p in points] == ["ok", "skipped", "ok", "ok"]
    assert {p["reason"] for p in points if p["status"] == "skipped"} == {"would pass the time limit"}


@pytest.mark.slow
def test_serve_cuts_a_point_at_the_time_limit_and_keeps_what_arrived(teacher_dir, tmp_path, capsys):
    """A point still running at its model's share of the time limit is cut: its requests are cancelled,
    it is recorded as "cut" with the tokens that had arrived, the model's larger points are skipped, and
    the tables mark it; each point says on stderr how it ended."""
    from linearize.bench import serve as serve_bench

    serve_bench.bench(tmp_path / "serve", model=str(teacher_dir), methods=["lizard"], quick=True,
                      options={"window": 8}, clients=[4, 8], prompt_lengths=[256], max_tokens=64, time_limit=0.2)
    points = json.loads((tmp_path / "serve" / "serve.json").read_text())["points"]
    assert [(p["clients"], p["status"]) for p in points] == [(4, "cut"), (8, "skipped")] * 2
    for p in points[::2]:
        assert p["reason"].startswith("cut at the time limit after") and "of 4 requests finished" in p["reason"]
        assert p["output_tokens"] < 4 * 64 and p["wall_s"] < 30
    assert {p["reason"] for p in points[1::2]} == {"a smaller point was cut at the time limit (256 x 4)"}
    markdown = (tmp_path / "serve" / "serve.md").read_text()
    assert "(cut)" in markdown and "cut at the time limit after" in markdown
    err = capsys.readouterr().err
    assert err.count("bench serve: ") == 4
    first = next(line for line in err.splitlines() if line.startswith("bench serve: 1 done; "))
    assert serve_bench.SOFTMAX in first and "clients 4, prompt_length 256: cut (cut at the time limit after" in first


def test_serve_interrupted_keeps_the_point_so_far_and_writes_the_tables(teacher_dir, tmp_path, monkeypatch):
    """Ctrl-C (a time limit's SIGINT) in a point: the point is recorded as cut with what had arrived,
    serve.json and serve.md are written, and the interrupt goes on to the caller."""
    from linearize.bench import serve as serve_bench

    client, sent = serve_bench._client, []

    async def interrupting_client(engine, prompt, params, record):
        # One SIGINT, once a measured point (not the warm-up's few tokens) has requests in flight.
        if params.max_tokens > 4 and not sent:
            sent.append(asyncio.get_running_loop().call_later(0.2, signal.raise_signal, signal.SIGINT))
        await client(engine, prompt, params, record)

    monkeypatch.setattr(serve_bench, "_client", interrupting_client)
    # As `linearize bench` listens (`cli.listen_for_interrupts`), also where pytest runs in the background.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            serve_bench.bench(tmp_path / "serve", model=str(teacher_dir), methods=["lizard"], quick=True,
                              options={"window": 8}, clients=[4], prompt_lengths=[4096], max_tokens=256)
    finally:
        signal.signal(signal.SIGINT, previous)
    points = json.loads((tmp_path / "serve" / "serve.json").read_text())["points"]
    assert points[-1]["status"] == "cut" and points[-1]["reason"].startswith("interrupted after")
    assert "(cut)" in (tmp_path / "serve" / "serve.md").read_text()


def test_serve_records_the_fitted_cost_of_a_prefill_call_and_the_table_shows_it():
    """The engine's fit of its prefill calls (fixed + per token) goes into the point, with the tokens
    its fixed share is worth (the least a paced call takes), and into the latency table's last column,
    with how the prefill ran where it went through the fixed-shape cache."""
    from types import SimpleNamespace

    from linearize.bench import serve as serve_bench
    from linearize.serve.pacing import PrefillCost

    cost = PrefillCost()
    assert serve_bench.prefill_fit(SimpleNamespace(prefill_cost=cost)) is None
    for tokens in (1000, 4000):  # 50 ms a call, 10 microseconds a token
        cost.add(tokens, 0.050 + tokens * 1e-5)
    fit = serve_bench.prefill_fit(SimpleNamespace(prefill_cost=cost))
    assert fit == pytest.approx({"fixed_ms": 50.0, "per_token_us": 10.0, "fixed_tokens": 5000.0})
    point = {"mode": "slots", "slots": 4, "prefill_calls": 2, "prefilled_tokens": 5000, "prefill_fit": fit}
    assert serve_bench.batching(point) == ("4 slots; prompts in 2 calls of 2,500 tokens on average; "
                                          "a call's fixed share 50 ms, 5,000 tokens' worth")
    point["prefill_path"] = "cuda graphs (30 captured)"
    assert serve_bench.batching(point) == ("4 slots; prompts in 2 calls of 2,500 tokens on average through a "
                                          "fixed-shape cache, cuda graphs (30 captured); a call's fixed share "
                                          "50 ms, 5,000 tokens' worth")


def test_serve_percentiles_interpolate():
    from linearize.bench.serve import percentile

    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_serve_at_full_size_on_a_cpu_is_refused_in_one_line(tmp_path, capsys):
    from linearize.cli import main

    assert main(["bench", "serve", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "pass --quick" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_serve_runs_a_hybrid_that_keeps_evenly_spaced_layers_softmax(teacher_dir, tmp_path):
    """`--softmax-layers even:N`: the method is converted with N layers kept softmax, evenly spaced (as a
    recipe's `softmax_by: even`), and served in hybrid rows; the Markdown says it is a hybrid."""
    from linearize.bench import serve as serve_bench

    serve_bench.bench(tmp_path / "serve", model=str(teacher_dir), methods=["lizard"], quick=True,
                      options={"window": 8}, clients=[2], prompt_lengths=[32], softmax_layers=1)
    results = json.loads((tmp_path / "serve" / "serve.json").read_text())
    from linearize.train.layer_selection import even_layers

    num_layers = json.loads((teacher_dir / "config.json").read_text())["num_hidden_layers"]
    assert results["models"][1]["linearize"]["softmax_layers"] == even_layers(list(range(num_layers)), 1)
    lizard = [p for p in results["points"] if p["model"] == "lizard"]
    assert lizard and all(p["mode"] == "hybrid" and p["status"] == "ok" for p in lizard)
    assert "1 layers kept softmax" in (tmp_path / "serve" / "serve.md").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--softmax-layers", "even:0"], "expected even:N with N >= 1"),
    (["--softmax-layers", "kl:2"], "expected even:N with N >= 1"),
    (["--softmax-layers", "even:2", "--layers", "full"], "use it with --layers all"),
])
def test_bench_softmax_layers_refuses_bad_input_in_one_line(tmp_path, capsys, flags, message):
    from linearize.cli import main

    assert main(["bench", "serve", "--quick", "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_model_bench_runs_named_variants_beside_the_methods(teacher_dir, tmp_path):
    """`--variant NAME=METHOD:OPTIONS`: one more converted model under its own name, its options over the
    shared ones, in the same tables as the methods (a target's row beside its reference in one run)."""
    model_bench.bench(tmp_path / "out", model=str(teacher_dir), methods=["lizard"], quick=True, contexts=[64],
                      batches=[1], options={"window": 8},
                      variants={"lizard-delta": {"method": "lizard", "options": {"memory": "delta"}}})
    results = json.loads((tmp_path / "out" / "model.json").read_text())
    models = {m["name"]: m for m in results["models"]}
    assert list(models) == [model_bench.SOFTMAX, "lizard", "lizard-delta"]
    assert models["lizard-delta"]["linearize"]["options"]["memory"] == "delta"
    assert models["lizard-delta"]["linearize"]["options"]["window"] == 8  # the shared option too
    assert models["lizard"]["linearize"]["options"]["memory"] == "gla"
    assert {p["model"] for p in results["points"]} >= {"lizard", "lizard-delta"}
    markdown = (tmp_path / "out" / "model.md").read_text()
    assert "| lizard-delta |" in markdown or "lizard-delta |" in markdown
    assert "`lizard-delta`: lizard with `memory=delta`" in markdown


@pytest.mark.parametrize("flags, message", [
    (["--variant", "x=nope:a=1"], "expected NAME=METHOD:KEY=VALUE"),
    (["--variant", "x=lizard:memory"], "--variant x expects key=value, got 'memory'"),
    (["--variant", "lizard=lizard:memory=delta"], "the name is taken"),
    (["--variant", "x=lizard:memory=bogus"], "--variant x:"),
])
def test_model_bench_refuses_a_bad_variant_in_one_line(tmp_path, capsys, flags, message):
    from linearize.cli import main

    assert main(["bench", "model", "--quick", "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
