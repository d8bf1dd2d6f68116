"""`linearize bench serve --scenario chat` on CPU with --quick: multi-turn conversations resubmitted whole,
the teacher beside a method with its prefix cache on and off."""

import itertools
import json

import pytest

from linearize.bench import chat
from linearize.bench.command import register
from linearize.bench.model import SOFTMAX
from linearize.bench.report import merge
from linearize.cli import _Parser, main


def run(*argv):
    parser = _Parser(prog="linearize")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    args.func(args)


@pytest.fixture(scope="module")
def results(tmp_path_factory, teacher_dir):
    out = tmp_path_factory.mktemp("chat")
    run("bench", "serve", "--scenario", "chat", "--out", out, "--model", teacher_dir, "--quick", "--set", "window=8")
    return out, json.loads((out / "serve_chat.json").read_text())


TEACHER = f"{SOFTMAX}, prefix cache on"


def runs_by_name(results):
    return {r["model"]: r for r in results["runs"]}


def test_every_run_serves_every_turn_of_every_conversation(results):
    _, results = results
    settings = results["settings"]
    runs = runs_by_name(results)
    assert list(runs) == ["lizard, prefix cache on", "lizard, prefix cache off", TEACHER]
    assert runs[TEACHER]["mode"] == "kv" and runs["lizard, prefix cache on"]["mode"] == "slots"
    for r in runs.values():
        assert r["status"] == "ok", r
        assert r["output_tokens"] == settings["conversations"] * settings["turns"] * settings["max_tokens"]
        assert [t["turn"] for t in r["turns"]] == list(range(1, settings["turns"] + 1))
        for t in r["turns"]:
            assert t["conversations"] == settings["conversations"]
            assert t["ttft_p99_ms"] >= t["ttft_p50_ms"] > 0 and t["output_tokens_per_s"] > 0
        # Each turn's prompt is the one before it, its answer and a new user message.
        contexts = [t["context"] for t in r["turns"]]
        steps = {b - a for a, b in itertools.pairwise(contexts)}
        assert steps == {settings["user_tokens"] + settings["max_tokens"]}
        assert contexts[-1] == settings["last_prompt_tokens"] <= settings["target_context"]
        # The per-request counts add up to what the engine prefilled.
        assert sum(t["prefilled_tokens"] for t in r["turns"]) == r["prefilled_tokens"]
        assert sum(t["prompt_tokens"] for t in r["turns"]) == r["prompt_tokens"]


def test_with_the_prefix_cache_later_turns_prefill_only_what_is_new(results):
    _, results = results
    settings = results["settings"]
    runs = runs_by_name(results)
    on, off = runs["lizard, prefix cache on"], runs["lizard, prefix cache off"]
    for t in on["turns"][1:]:
        assert t["prefilled_tokens"] < t["prompt_tokens"]
        # At most the new user message and answer, plus what the previous prompt left short of a block.
        new = settings["user_tokens"] + settings["max_tokens"] + settings["prefix_block"]
        assert t["prefilled_tokens"] <= settings["conversations"] * new
    # Turn 1: the conversations after the first find the shared system prompt cached.
    # The teacher, served as vLLM serves a model, restores its keys and values by prefix too.
    for r in (on, runs[TEACHER]):
        assert r["turns"][0]["cached_tokens"] >= (settings["conversations"] - 1) * settings["system_tokens"]
        assert r["prefix_cache_stats"]["hit_tokens"] == sum(t["cached_tokens"] for t in r["turns"]) > 0
        assert r["prefilled_tokens"] < r["prompt_tokens"]
    assert off["prefix_cache_stats"]["enabled"] is False
    assert all(t["prefilled_tokens"] == t["prompt_tokens"] and t["cached_tokens"] == 0 for t in off["turns"])


def test_greedy_answers_are_the_same_with_the_cache_on_and_off(results):
    _, results = results
    runs = runs_by_name(results)
    on, off = runs["lizard, prefix cache on"]["answers_sha256"], runs["lizard, prefix cache off"]["answers_sha256"]
    assert on == off and len(set(on)) == len(on) == results["settings"]["conversations"]
    assert results["comparisons"][0]["answers_match_cache_off"] is True


def test_the_comparisons_read_the_targets_from_one_json(results):
    _, results = results
    (row,) = results["comparisons"]
    runs = runs_by_name(results)
    assert row["method"] == "lizard" and [t["turn"] for t in row["turns"]] == [1, 2, 3]
    last = row["last_turn"]
    on_last, off_last = runs["lizard, prefix cache on"]["turns"][-1], runs["lizard, prefix cache off"]["turns"][-1]
    teacher_last = runs[TEACHER]["turns"][-1]
    assert last["ttft_p50_over_cache_off"] == pytest.approx(on_last["ttft_p50_ms"] / off_last["ttft_p50_ms"])
    assert last["output_tokens_per_s_over_teacher"] == pytest.approx(
        on_last["output_tokens_per_s"] / teacher_last["output_tokens_per_s"])
    assert last["ttft_target_met"] == (last["ttft_p50_over_cache_off"] <= chat.TTFT_TARGET)
    assert last["rate_target_met"] == (last["output_tokens_per_s_over_teacher"] >= chat.RATE_TARGET)
    assert row["output_tokens_per_s_over_teacher"] > 0


def test_the_tables_and_the_plot_render_and_merge_into_a_doc(results):
    out, data = results
    markdown = (out / "serve_chat.md").read_text()
    assert "| lizard, prefix cache on | 3 | 127 |" in markdown
    assert "Against the targets" in markdown and "greedy answers with the prefix cache on and off: the same" in markdown
    assert (out / "serve_chat.ttft.png").stat().st_size > 0
    doc = merge("# Serving\n", data)
    assert "### Serving chat: " in doc and "| lizard | 3 | 127 |" in doc
    assert merge(doc, data) == doc  # a rerun replaces its section


def test_user_messages_fill_the_target_context():
    settings = chat.settings_for(False, {})
    assert 32768 - settings["turns"] < settings["last_prompt_tokens"] <= 32768
    settings = chat.settings_for(False, {"target_context": 40000, "turns": 3})
    assert 40000 - 3 < settings["last_prompt_tokens"] <= 40000
    assert chat.settings_for(True, {"user_tokens": 5})["user_tokens"] == 5
    with pytest.raises(ValueError, match="--target-context 3000 leaves no room"):
        chat.settings_for(False, {"target_context": 3000})


def test_a_run_past_the_time_limit_is_cut_and_the_tables_still_render(teacher_dir, tmp_path):
    chat.bench(tmp_path, model=str(teacher_dir), methods=["lizard"], quick=True, options={"window": 8},
               time_limit=1e-3)
    results = json.loads((tmp_path / "serve_chat.json").read_text())
    assert [r["status"] for r in results["runs"]] == ["cut"] * 3
    assert "cut at the time limit" in (tmp_path / "serve_chat.md").read_text()


@pytest.mark.parametrize("argv", [
    ["--scenario", "talk"],
    ["--scenario", "chat", "--turns", "0"],
    ["--scenario", "chat", "--conversations", "-1"],
    ["--scenario", "chat", "--system-tokens", "x"],
    ["--scenario", "chat", "--user-tokens", "1k", "--target-context", "32k"],
    ["--scenario", "chat", "--prefix-cache-memory", "0"],
    ["--scenario", "chat", "--prefix-cache-host-memory", "0"],
    ["--quick", "--prefix-cache-host-memory", "1GiB"],
    ["--scenario", "chat", "--prefix-block", "0"],
    ["--scenario", "chat", "--quick", "--clients", "4"],
    ["--quick", "--turns", "4"],
    ["--scenario", "chat", "--quick", "--target-context", "40"],
])
def test_bad_flags_exit_2_with_one_line_and_write_nothing(argv, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "serve", "--out", str(out), *argv]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not out.exists()
