import argparse
import json
import re
import sys
import types

import pytest

from linearize.eval import api, command, evaluate, longcontext, report, ruler, write_report
from linearize.eval.harness import ZEROSHOT
from linearize.eval.results_file import read_results

LONG_TASKS = api.SHORTHANDS["longcontext"]  # the six synthetic tasks (RULER's and BABILong's: their own tests)


def test_parse_tasks_expands_shorthands_in_order_without_repeats():
    assert api.parse_tasks("ppl,zeroshot,piqa") == ["ppl", *ZEROSHOT]
    assert api.parse_tasks(["longcontext"]) == list(LONG_TASKS)
    assert api.parse_tasks(" mmlu , lambada ") == ["mmlu", "lambada"]


def test_parse_tasks_rejects_unknown_names_in_one_sentence():
    with pytest.raises(ValueError, match=r"^Unknown task 'pikachu'; choose from ppl, .*lm-eval task name\.$"):
        api.parse_tasks("ppl,pikachu")
    with pytest.raises(ValueError, match="No tasks given"):
        api.parse_tasks(" , ")


def test_parse_tasks_passes_lm_eval_names_through():
    assert api.parse_tasks("boolq") == ["boolq"]


def test_parse_lengths():
    assert api.parse_lengths("1k,2k,512,32K") == [512, 1024, 2048, 32768]
    assert api.parse_lengths([4096, "1k", 4096]) == [1024, 4096]
    assert api.parse_lengths("0,1k") == [0, 1024]  # 0: BABILong's facts alone
    for bad in ("1.5k", "-1", "2m", "abc", ""):
        with pytest.raises(ValueError, match="Bad length|No lengths"):
            api.parse_lengths(bad)


def test_a_lone_number_is_one_length_or_depth():
    """A recipe's `lengths: 512` (or `eval.lengths=512`) reads as a YAML number, not a string."""
    assert api.parse_lengths(512) == [512]
    assert api.parse_lengths(0) == [0]
    assert api.parse_depths(50) == [50]
    assert api.parse_depths(12.5) == [12.5]
    names = api.parse_tasks("ppl,ruler")
    assert api.parse_task_lengths(names, {"ppl": 512, "ruler": 4096})["ppl"] == [512]
    assert api.parse_task_lengths(names, {"ruler": 4096})["niah_multikey_1"] == [4096]
    for bad in (True, 1.5, -1, None):  # said as a bad length, not as "not iterable"
        with pytest.raises(ValueError, match=f"Bad length {str(bad)!r}"):
            api.parse_lengths(bad)
    with pytest.raises(ValueError, match="Bad depth '101'"):
        api.parse_depths(101)


def test_parse_depths():
    assert api.parse_depths("100,0,50,12.5") == [0, 12.5, 50, 100]
    for bad in ("101", "-5", "half"):
        with pytest.raises(ValueError, match="Bad depth"):
            api.parse_depths(bad)


ALL_TASKS = "ppl,zeroshot,mmlu,lambada,longcontext"


@pytest.fixture(scope="module")
def results(model, tokenizer, ppl_text, essay_file, fake_olmo):
    """Every task end to end on a tiny model: small limit, short lengths, the miniature olmo data."""
    model.config.linearize = {"method": "lizard", "window": 8}  # as a converted student carries it
    try:
        yield evaluate(
            model, tokenizer, ALL_TASKS, limit=2, lengths="1k,2k", depths="0,100", samples=3, batch=4,
            harness_batch=5, seed=3, text=str(ppl_text), essay=str(essay_file), data_dir=str(fake_olmo), ppl_max_tokens=4096,
            model_spec="tiny-llama",
        )
    finally:
        del model.config.linearize


def test_evaluate_runs_every_task(results):
    expected = api.parse_tasks(ALL_TASKS)
    assert list(results["tasks"]) == expected
    assert len(expected) == 1 + 7 + 6
    for name, result in results["tasks"].items():
        assert result["wall_time_s"] > 0, name
    assert [r["windows"] for r in results["tasks"]["ppl"]["by_length"]] == [2, 2]
    for name in LONG_TASKS:
        result = results["tasks"][name]
        assert 0.0 <= result["score"] <= 1.0
        per_variant = 3 if name == "niah_single" else 1
        assert len(result["samples"]) == 2 * 2 * 2 * per_variant  # lengths x depths x min(samples, limit)
        assert {"length", "depth", "answers", "prediction", "score", "seed", "tokens"} <= set(result["samples"][0])
    assert 0.0 <= results["zeroshot_average"]["value"] <= 1.0


def test_provenance(results):
    prov = results["provenance"]
    assert prov["model"] == "tiny-llama"
    assert prov["method_config"] == {"method": "lizard", "window": 8}
    assert prov["seed"] == 3 and prov["limit"] == 2 and prov["samples_per_cell"] == 2
    assert prov["batch"] == 4 and prov["harness_batch"] == 5
    assert prov["lengths"] == [1024, 2048] and prov["depths"] == [0, 100]
    assert prov["device"] == "cpu" and prov["dtype"] == "float32"
    assert prov["versions"]["torch"] and prov["versions"]["transformers"] and prov["versions"]["lm_eval"]
    assert prov["lm_eval_task_versions"]["mmlu"] is not None
    assert prov["wall_time_s"] > 0


def test_lm_eval_runs_at_its_own_batch(model, tokenizer, monkeypatch):
    from linearize.eval import harness

    class Stop(Exception):
        pass

    seen = []

    def record(*args, batch, **kwargs):
        seen.append(batch)
        raise Stop

    monkeypatch.setattr(harness, "run_harness", record)
    for extra in ({"harness_batch": 64}, {}):
        with pytest.raises(Stop):
            evaluate(model, tokenizer, "piqa", batch=4, **extra)
    assert seen == [64, 4]
    with pytest.raises(ValueError, match="harness_batch must be a positive integer"):
        evaluate(model, tokenizer, "piqa", harness_batch=0)


def test_long_context_is_deterministic_by_seed(model, tokenizer):
    run = lambda seed: evaluate(model, tokenizer, "passkey", lengths="1k", depths="50", samples=2, seed=seed)
    first, again, other = run(1), run(1), run(2)
    assert first["tasks"]["passkey"]["samples"] == again["tasks"]["passkey"]["samples"]
    assert first["tasks"]["passkey"]["samples"] != other["tasks"]["passkey"]["samples"]


def test_progress_gets_the_finished_tasks_after_each_one(model, tokenizer, ppl_text):
    seen = []
    final = evaluate(model, tokenizer, "ppl,passkey", lengths="1k", depths="50", samples=1, text=str(ppl_text),
                     ppl_max_tokens=2048, on_progress=seen.append)
    assert [list(r["tasks"]) for r in seen] == [["ppl"]]
    assert seen[0]["provenance"]["partial"] is True and "partial" not in final["provenance"]
    assert seen[0]["tasks"]["ppl"] == final["tasks"]["ppl"]


def test_resume_keeps_the_finished_tasks_of_the_same_evaluation(model, tokenizer, ppl_text):
    seen = []
    settings = {"lengths": "1k", "depths": "50", "samples": 1, "text": str(ppl_text), "ppl_max_tokens": 2048}
    evaluate(model, tokenizer, "ppl,passkey", **settings, on_progress=seen.append)
    partial = json.loads(json.dumps(seen[0]))  # as read back from the file
    partial["tasks"]["ppl"]["kept"] = True  # marks the earlier result: a rerun would not have it
    resumed = evaluate(model, tokenizer, "ppl,passkey", **settings, resume=partial)
    assert resumed["tasks"]["ppl"]["kept"] is True and "passkey" in resumed["tasks"]
    assert "partial" not in resumed["provenance"]
    other = evaluate(model, tokenizer, "ppl", **{**settings, "lengths": "512"}, resume=partial)
    assert "kept" not in other["tasks"]["ppl"]  # other settings: the earlier result does not apply


def test_task_lengths_override_the_sweep_for_one_task_and_count_in_resuming(model, tokenizer, ppl_text):
    settings = {"lengths": "512,1k", "depths": "50", "samples": 1, "text": str(ppl_text), "ppl_max_tokens": 2048}
    first = evaluate(model, tokenizer, "ppl,passkey", **settings, task_lengths={"passkey": "1k"})
    assert [r["length"] for r in first["tasks"]["ppl"]["by_length"]] == [512, 1024]
    assert [r["length"] for r in first["tasks"]["passkey"]["by_length"]] == [1024]
    assert first["provenance"]["task_lengths"] == {"passkey": [1024]}
    earlier = json.loads(json.dumps(first))
    earlier["tasks"]["ppl"]["kept"] = earlier["tasks"]["passkey"]["kept"] = True
    # A finished run extended by one task keeps what it has; a task whose lengths changed runs again.
    more = evaluate(model, tokenizer, "ppl,passkey,variable_tracking", **settings, resume=earlier,
                    task_lengths={"passkey": "512", "variable_tracking": "1k"})
    assert more["tasks"]["ppl"]["kept"] is True and "kept" not in more["tasks"]["passkey"]
    assert [r["length"] for r in more["tasks"]["variable_tracking"]["by_length"]] == [1024]
    with pytest.raises(ValueError, match="not ppl or a long-context task"):
        evaluate(model, tokenizer, "ppl", **settings, task_lengths={"passkey": "1k"})



# --- a long-context task cut short goes on from its first unfinished length

LONG = {"lengths": "512,1k,2k", "depths": "0,100", "samples": 1}


@pytest.fixture
def generated(monkeypatch):
    """The length of every generate call evaluate makes (one call per length)."""
    lengths = []
    real = api.greedy_generate

    def counting(model, tokenizer, prompts, *args, **kwargs):
        tokens = max(len(tokenizer(p).input_ids) for p in prompts)
        lengths.append(1 << (tokens - 1).bit_length())  # a prompt fills its length to within 100 tokens
        return real(model, tokenizer, prompts, *args, **kwargs)

    monkeypatch.setattr(api, "greedy_generate", counting)
    return lengths


def cut_after_first_length(model, tokenizer, **settings) -> dict:
    """Run passkey over LONG (with `settings`), stopped as a killed job is once its first save is made
    (with LONG's batch: its first length); what was saved."""
    saved = []

    def save_then_stop(results):
        saved.append(json.loads(json.dumps(results)))  # as read back from the file
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        evaluate(model, tokenizer, "passkey", **{**LONG, **settings}, on_progress=save_then_stop)
    return saved[-1]


def test_a_cut_long_context_task_resumes_to_the_uninterrupted_result(model, tokenizer, generated):
    whole = evaluate(model, tokenizer, "passkey", **LONG)["tasks"]["passkey"]
    cut = cut_after_first_length(model, tokenizer)
    entry = cut["tasks"]["passkey"]
    assert cut["provenance"]["partial"] is True and entry["partial"] is True
    assert entry["lengths"] == [512] and entry["samples"] == whole["samples"][:2] and entry["wall_time_s"] > 0
    seen = []
    resumed = evaluate(model, tokenizer, "passkey", **LONG, resume=cut, on_progress=seen.append)["tasks"]["passkey"]
    assert generated == [512, 1024, 2048, 512, 1024, 2048]  # whole, cut, then resumed without 512
    assert [r["tasks"]["passkey"]["lengths"] for r in seen] == [[512, 1024]]
    assert resumed.pop("wall_time_s") > entry["wall_time_s"]  # the cut run's time counts
    whole.pop("wall_time_s")
    assert resumed == whole and list(resumed) == list(whole)


def test_a_cut_task_is_never_taken_for_a_finished_one(model, tokenizer):
    cut = cut_after_first_length(model, tokenizer)
    assert api.resumable_tasks(cut, cut["provenance"]) == ({}, {"passkey": cut["tasks"]["passkey"]})


def test_a_cut_task_starts_over_under_other_settings(model, tokenizer, generated):
    cut = cut_after_first_length(model, tokenizer)
    evaluate(model, tokenizer, "passkey", **{**LONG, "lengths": "512,1k"}, resume=cut)
    evaluate(model, tokenizer, "passkey", **LONG, task_lengths={"passkey": "512,1k"}, resume=cut)
    evaluate(model, tokenizer, "passkey", **LONG, seed=1, resume=cut)
    assert generated == [512, 512, 1024, 512, 1024, 512, 1024, 2048]  # 512 each time


def test_the_report_of_a_cut_run_says_what_is_missing(model, tokenizer, tmp_path):
    cut = cut_after_first_length(model, tokenizer)
    write_report(cut, tmp_path / "eval.json")
    md = (tmp_path / "eval.md").read_text()
    assert "**Partial: the run stopped before it finished.**" in md and "Cut short (its finished lengths below): passkey" in md
    assert re.search(r"\| passkey \(partial\) \| [0-9.]+ \| – \| – \| [0-9.]+ \|", md), md  # 512 of 512, 1K, 2K


def test_ruler_shorthand():
    assert api.parse_tasks("ruler") == list(ruler.RULER_TASKS)  # RULER's own names (tests/eval/test_ruler.py)


def test_write_report(results, tmp_path):
    out = tmp_path / "run" / "eval.json"
    paths = write_report(results, out)
    names = {p.name for p in paths}
    expected_plots = {f"eval.{t}.png" for t in LONG_TASKS} | {"eval.ppl_by_length.png", "eval.loss_by_position.png"}
    assert names == {"eval.json", "eval.samples.jsonl.gz", "eval.md"} | expected_plots
    for path in paths:
        assert path.is_file() and path.stat().st_size > 0
    for plot in expected_plots:
        assert (out.parent / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_results(out) == json.loads(json.dumps(results))
    md = (out.parent / "eval.md").read_text()
    assert "# Evaluation of tiny-llama" in md
    assert "| piqa |" in md and "| passkey |" in md and "Zero-shot average" in md
    assert "![passkey](eval.passkey.png)" in md


def test_report_module_writes_the_markdown_and_plots_again_from_the_json_alone(results, tmp_path, capsys):
    out = tmp_path / "eval.json"
    write_report(results, out)
    md, plots = out.with_suffix(".md").read_text(), sorted(tmp_path.glob("*.png"))
    out.with_suffix(".md").unlink()
    for plot in plots:
        plot.unlink()
    assert report.main([str(out)]) == 0
    assert out.with_suffix(".md").read_text() == md and sorted(tmp_path.glob("*.png")) == plots
    assert capsys.readouterr().out == f"{out.with_suffix('.md')}\n"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"tasks": {}}'])
def test_report_module_refuses_what_is_not_a_results_file_before_writing_any(results, tmp_path, text, capsys):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    write_report(results, good)
    good.with_suffix(".md").unlink()
    bad.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        report.main([str(good), str(bad)])
    assert exit_.value.code == 2 and not good.with_suffix(".md").exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {bad}: not a")


# --- the CLI


def parser():
    root = argparse.ArgumentParser(prog="linearize")
    command.register(root.add_subparsers(dest="command"))
    return root


@pytest.fixture
def fake_loading(monkeypatch, model, tokenizer):
    """Stand-in for linearize.loading, so the CLI test needs no checkpoint."""
    calls = []

    def load_model(spec, dtype=None, device=None, inference_options=None):
        assert not inference_options  # these tests pass no --set
        calls.append((spec, dtype, device))
        return model

    module = types.SimpleNamespace(load_model=load_model, load_tokenizer=lambda spec: tokenizer)
    monkeypatch.setitem(sys.modules, "linearize.loading", module)
    return calls


def test_cli_writes_results(fake_loading, tmp_path, essay_file, capsys):
    out = tmp_path / "cli.json"
    args = parser().parse_args([
        "eval", "--model", "smollm2", "--tasks", "passkey,niah_multikey", "--out", str(out),
        "--limit", "1", "--lengths", "1k", "--depths", "0,100", "--batch", "2", "--device", "cpu",
        "--dtype", "float32", "--seed", "5", "--essay", str(essay_file), "--task-lengths", "niah_multikey=2k",
    ])
    assert args.func(args) == 0
    assert fake_loading == [("smollm2", "float32", "cpu")]
    results = read_results(out)
    assert results["provenance"]["model"] == "smollm2" and results["provenance"]["seed"] == 5
    assert len(results["tasks"]["passkey"]["samples"]) == 2
    assert [r["length"] for r in results["tasks"]["niah_multikey"]["by_length"]] == [2048]
    assert (tmp_path / "cli.md").is_file() and (tmp_path / "cli.passkey.png").is_file()
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "passkey=" in printed


def test_cli_resume_keeps_the_finished_tasks(fake_loading, tmp_path, essay_file, monkeypatch):
    out = tmp_path / "cli.json"
    common = ["--model", "smollm2", "--out", str(out), "--limit", "1", "--lengths", "1k", "--depths", "0",
              "--batch", "2", "--device", "cpu", "--dtype", "float32", "--essay", str(essay_file)]
    args = parser().parse_args(["eval", "--tasks", "passkey", *common])
    assert args.func(args) == 0
    first = read_results(out)["tasks"]["passkey"]
    ran = []
    real = longcontext.run_longcontext
    monkeypatch.setattr(longcontext, "run_longcontext", lambda name, *a, **kw: ran.append(name) or real(name, *a, **kw))
    args = parser().parse_args(["eval", "--tasks", "passkey,niah_multikey", "--resume", *common])
    assert args.func(args) == 0
    results = read_results(out)
    assert ran == ["niah_multikey"] and results["tasks"]["passkey"] == first
    assert "partial" not in results["provenance"]


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"),
    ("{not json", "is not a results JSON"),
    ('{"format": "something-else"}', "is not a results file of `linearize eval`"),
])
def test_cli_resume_from_a_missing_or_foreign_file_fails_before_loading(content, message, fake_loading, tmp_path):
    out = tmp_path / "x.json"
    if content is not None:
        out.write_text(content)
    args = parser().parse_args(["eval", "--model", "m", "--tasks", "ppl", "--out", str(out), "--resume"])
    with pytest.raises(ValueError, match=message):
        args.func(args)
    assert fake_loading == []


@pytest.mark.parametrize("flags,message", [
    (["--tasks", "ppl,nope"], "Unknown task 'nope'"),
    (["--tasks", "ppl", "--lengths", "1k,huge"], "Bad length 'huge'"),
    (["--tasks", "ppl", "--limit", "0"], "--limit must be a positive integer"),
    (["--tasks", "piqa", "--harness-batch", "0"], "--harness-batch must be a positive integer"),
    (["--tasks", "passkey", "--lengths", "64"], "Length 64 is too short for a passkey prompt"),
    (["--tasks", "ppl", "--text", "/no/such/book.txt"], "--text /no/such/book.txt is not a file"),
    (["--tasks", "piqa", "--task-limit", "mmlu=20"], "names 'mmlu', which is not an lm-eval task of this run"),
    (["--tasks", "ppl,piqa", "--task-limit", "ppl=3"], "names 'ppl'"),
    (["--tasks", "mmlu", "--task-limit", "mmlu=0"], "TASK=N with N a positive integer"),
    (["--tasks", "mmlu", "--task-limit", "mmlu"], "TASK=N with N a positive integer"),
    (["--tasks", "ppl", "--task-lengths", "ppl=4q"], "Bad length '4q'"),
    (["--tasks", "ppl,piqa", "--task-lengths", "piqa=4k"], "not ppl or a long-context task"),
])
def test_cli_bad_input_fails_before_loading(flags, message, fake_loading, tmp_path):
    args = parser().parse_args(["eval", "--model", "m", "--out", str(tmp_path / "x.json"), *flags])
    with pytest.raises(ValueError, match=message):
        args.func(args)
    assert fake_loading == []


def test_task_lengths_take_a_shorthand_for_its_tasks():
    from linearize.eval.api import parse_task_lengths, parse_tasks
    from linearize.eval.ruler import RULER_TASKS

    names = parse_tasks("zeroshot,ruler,niah_single")
    parsed = parse_task_lengths(names, {"ruler": "4k", "niah_single": "1k,2k"})
    assert parsed == {**{task: [4096] for task in RULER_TASKS}, "niah_single": [1024, 2048]}
    with pytest.raises(ValueError, match="not ppl or a long-context task"):
        parse_task_lengths(names, {"zeroshot": "4k"})
    # A shorthand whose tasks this run leaves out is named as written, beside the task that is missing.
    with pytest.raises(ValueError, match=r"task lengths name 'ruler' \(its task 'niah_single_1'\), which is not"):
        parse_task_lengths(parse_tasks("zeroshot,niah_single"), {"ruler": "4k"})
    with pytest.raises(TypeError, match=r"task lengths must be a mapping of task to lengths, .* got '4k'"):
        parse_task_lengths(names, "4k")


def test_a_task_cut_inside_a_length_keeps_its_answered_prompts(model, tokenizer, generated, tmp_path):
    settings = {**LONG, "batch": 1}  # one prompt a generate call, each saved as it ends
    whole = evaluate(model, tokenizer, "passkey", **settings)["tasks"]["passkey"]
    cut = cut_after_first_length(model, tokenizer, batch=1)
    entry = cut["tasks"]["passkey"]
    assert entry["partial"] is True and entry["lengths"] == [] and entry["samples"] == whole["samples"][:1]
    write_report(cut, tmp_path / "eval.json")  # no length finished: no scores, and the report says so
    assert "Cut short (its finished lengths below): passkey" in (tmp_path / "eval.md").read_text()
    generated.clear()
    resumed = evaluate(model, tokenizer, "passkey", **settings, resume=cut)["tasks"]["passkey"]
    assert generated == [512, 1024, 1024, 2048, 2048]  # the second 512 prompt, then the rest
    resumed.pop("wall_time_s"), whole.pop("wall_time_s")
    assert resumed == whole
