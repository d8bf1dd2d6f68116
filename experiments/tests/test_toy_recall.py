"""experiments/retrieval/toy_recall.py on a budget of a few steps: the task's sequences are what the
docstring says, and the outputs name every configuration and distance bucket (no claim on accuracy)."""

import json

import pytest
import torch

from experiments.retrieval.toy_recall import buckets, draw_batch, main, parse_args, vocabulary


def test_each_query_asks_its_facts_key_at_its_distance():
    args = parse_args(["--out", "x.json", "--facts", "6"])
    tokens, written, where, target, distance = draw_batch(args, 4, torch.Generator().manual_seed(0))
    fillers, keys, values = vocabulary(args)
    spans = buckets(args.window)
    for row in range(4):
        facts = (written[row] >= 0).nonzero().flatten()
        assert len(facts) == 6 and set(where[row].tolist()).isdisjoint(facts.tolist())
        for q, value, d in zip(where[row].tolist(), target[row].tolist(), distance[row].tolist(), strict=True):
            fact = q - d
            assert written[row, fact] == value and value in values and written[row, q] == -1
            assert tokens[row, q] == tokens[row, fact] and tokens[row, q].item() in keys
            assert any(lo <= d < hi for lo, hi in spans)
        others = torch.ones(args.length, dtype=torch.bool)
        others[facts], others[where[row]] = False, False
        assert all(t in fillers for t in tokens[row, others].tolist())
        assert len(set(tokens[row, facts].tolist())) == 6  # distinct keys


def test_a_few_steps_write_the_json_and_the_table(tmp_path):
    out = tmp_path / "recall.json"
    configs = "softmax,window,delta a=0.99"
    assert main(["--out", str(out), "--steps", "2", "--batch", "2", "--eval-sequences", "2", "--facts", "4",
                 "--hidden", "32", "--configs", configs]) == 0
    results = json.loads(out.read_text())
    assert results["format"] == "linearize-toy-recall/1"
    names = ["0.5-1W", "1-2W", "2-4W", "4-7W"]
    assert [r["config"] for r in results["results"]] == configs.split(",")
    for r in results["results"]:
        assert list(r["by_bucket"]) == names
        assert sum(b["queries"] for b in r["by_bucket"].values()) == 2 * 4
        assert all((b["accuracy"] is None) == (b["queries"] == 0) for b in r["by_bucket"].values())
        assert all(0 <= b["accuracy"] <= 1 for b in r["by_bucket"].values() if b["queries"])
        assert r["final_train_loss"] > 0 and r["train_seconds"] >= 0
    softmax, window, delta = results["results"]
    assert softmax["options"] is None and "alpha" not in softmax
    assert window["options"] == {"rope_in_window": True} and "mu" not in window
    assert delta["options"]["memory_decay_init"] == 0.99 and len(delta["memory_decay"]) == 2
    table = out.with_suffix(".md").read_text()
    assert "| config | " + " | ".join(names) in table and "| delta a=0.99 |" in table and "--steps 2" in table


def test_bad_flags_exit_2(tmp_path):
    with pytest.raises(SystemExit) as stop:
        main(["--out", str(tmp_path / "x.json"), "--configs", "softmax,nope"])
    assert stop.value.code == 2
    assert not (tmp_path / "x.json").exists()
