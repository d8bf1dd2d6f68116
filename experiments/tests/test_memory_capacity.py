"""experiments/retrieval/memory_capacity.py: the delta rule gives back what it was written, and keeps
needles in a repetitive haystack where a summed state dilutes them; the table names every cell."""

import json

import pytest

from experiments.retrieval.memory_capacity import main


def test_the_delta_rule_keeps_needles_a_summed_state_dilutes(tmp_path):
    out = tmp_path / "capacity.json"
    assert main(["--out", str(out), "--pairs", "8,512", "--trials", "3", "--strengths", "1"]) == 0
    cells = json.loads(out.read_text())["cells"]

    def mean(scenario, memory, n):
        got = [c["recalled"] for c in cells if (c["scenario"], c["memory"], c["pairs"]) == (scenario, memory, n)]
        assert len(got) == 3
        return sum(got) / 3

    # Fewer pairs than dimensions: the delta rule reads back every value exactly enough to find it.
    assert mean("distinct", "delta b=1", 8) == 1.0
    # 512 filler writes along one shared direction: the delta rule overwrites the filler with itself,
    # the sum piles it onto the needles' read-out.
    assert mean("haystack", "delta b=1", 512) >= 0.9
    assert mean("haystack", "sum", 512) < 0.5
    table = out.with_suffix(".md").read_text()
    assert "## haystack" in table and "| delta b=1 | 1.00 |" in table and "N=512" in table


def test_bad_flags_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--out", str(tmp_path / "x.json"), "--strengths", "2"])
    assert stop.value.code == 2
    assert not (tmp_path / "x.json").exists()
