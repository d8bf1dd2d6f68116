"""A results file on disk: the scores in FILE.json, the per-sample records gzipped beside it."""

import gzip
import json

import pytest

from linearize.eval import command
from linearize.eval.report import write_json
from linearize.eval.results_file import SAMPLES_KEY, read_results, samples_path, split_samples, write_results

RESULTS = {
    "format": "linearize-eval/1",
    "provenance": {"model": "tiny", "partial": False},
    "tasks": {
        "piqa": {"acc": 0.5, "acc_norm": 0.75},
        "passkey": {"score": 0.5, "samples": [{"length": 512, "prediction": "12345", "score": 1.0},
                                              {"length": 512, "prediction": "café ☕", "score": 0.0}],
                    "by_length": [{"length": 512, "score": 0.5}]},
        "squad_gen": {"exact_match": 0.0, "samples": [{"generation": "Paris", "answers": ["Paris"]}]},
    },
    "zeroshot_average": {"value": 0.75},
}


def test_the_json_keeps_the_scores_and_the_records_go_beside_it(tmp_path):
    out = write_results(RESULTS, tmp_path / "eval.json")
    scores = json.loads(out.read_text())
    assert scores[SAMPLES_KEY] == "eval.samples.jsonl.gz" and samples_path(out) == tmp_path / "eval.samples.jsonl.gz"
    assert not any("samples" in task for task in scores["tasks"].values())
    assert scores["tasks"]["passkey"]["by_length"] == RESULTS["tasks"]["passkey"]["by_length"]
    with gzip.open(samples_path(out), "rt", encoding="utf-8") as lines:
        entries = [json.loads(line) for line in lines]
    assert entries == [{"task": "passkey", "samples": RESULTS["tasks"]["passkey"]["samples"]},
                       {"task": "squad_gen", "samples": RESULTS["tasks"]["squad_gen"]["samples"]}]
    assert read_results(out) == RESULTS
    assert read_results(out, samples=False) == split_samples(RESULTS)[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "eval.samples.jsonl.gz"]  # no .tmp left


def test_the_same_results_give_the_same_bytes(tmp_path):
    first, second = tmp_path / "a" / "eval.json", tmp_path / "b" / "eval.json"
    write_results(RESULTS, first)
    write_results(json.loads(json.dumps(RESULTS)), second)
    assert first.read_bytes() == second.read_bytes()
    assert samples_path(first).read_bytes() == samples_path(second).read_bytes()
    assert samples_path(first).read_bytes()[4:8] == b"\0\0\0\0"  # gzip's mtime field: none


def test_the_json_has_a_line_per_task_and_per_provenance_field(tmp_path):
    out = write_results(RESULTS, tmp_path / "eval.json")
    assert out.read_text() == """{
  "format": "linearize-eval/1",
  "provenance": {
    "model": "tiny",
    "partial": false
  },
  "tasks": {
    "piqa": {"acc":0.5,"acc_norm":0.75},
    "passkey": {"score":0.5,"by_length":[{"length":512,"score":0.5}]},
    "squad_gen": {"exact_match":0.0}
  },
  "zeroshot_average": {
    "value": 0.75
  },
  "samples_file": "eval.samples.jsonl.gz"
}
"""


def test_a_file_with_the_records_inline_reads_as_it_is(tmp_path):
    old = tmp_path / "eval.json"
    old.write_text(json.dumps(RESULTS, indent=2))
    assert read_results(old) == RESULTS
    write_results(read_results(old), old)  # as experiments/scripts/split_samples.py converts one
    assert read_results(old) == RESULTS and old.stat().st_size < len(json.dumps(RESULTS, indent=2))


def test_results_without_records_take_a_stale_records_file_away(tmp_path):
    out = write_results(RESULTS, tmp_path / "eval.json")
    scores_only = split_samples(RESULTS)[0]
    write_results(scores_only, out)
    assert not samples_path(out).exists() and SAMPLES_KEY not in json.loads(out.read_text())
    assert read_results(out) == scores_only


def test_a_failed_write_leaves_the_earlier_results_whole(tmp_path):
    out = write_results(RESULTS, tmp_path / "eval.json")
    before = out.read_bytes(), samples_path(out).read_bytes()
    looped = json.loads(json.dumps(RESULTS))
    looped["provenance"]["self"] = looped["provenance"]  # the scores cannot be serialized; the records can
    with pytest.raises(ValueError, match="Circular reference"):
        write_results(looped, out)
    assert (out.read_bytes(), samples_path(out).read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "eval.samples.jsonl.gz"]


def test_the_report_writer_writes_the_pair(tmp_path):
    """write_json (each partial result while a run goes on) splits as the final write_report does."""
    assert write_json(RESULTS, tmp_path / "partial.json") == tmp_path / "partial.json"
    assert samples_path(tmp_path / "partial.json").is_file() and read_results(tmp_path / "partial.json") == RESULTS


def test_resume_reads_the_records_back_and_names_a_missing_records_file(tmp_path):
    out = write_results(RESULTS, tmp_path / "eval.json")
    assert command.read_previous(str(out)) == RESULTS
    samples_path(out).unlink()
    with pytest.raises(ValueError, match=r"^--resume: .*eval\.json: its per-sample records cannot be read"):
        command.read_previous(str(out))
    samples_path(out).write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="its per-sample records cannot be read"):
        command.read_previous(str(out))

