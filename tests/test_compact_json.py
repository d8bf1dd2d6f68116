"""linearize.cli_args.compact_json: the layout of the JSON files the project writes and commits."""

import json
import math

from linearize.cli_args import compact_json

RESULTS = {"bench": "model", "settings": {"contexts": [1024, 4096], "dtype": "bf16"},
           "points": [{"context": 1024, "ms": 1.5}, {"context": 4096, "ms": None}], "wall_time_s": 3.0, "empty": {}}


def test_a_line_per_member_of_the_first_two_levels_and_compact_below():
    assert compact_json(RESULTS) == """{
  "bench": "model",
  "settings": {
    "contexts": [1024,4096],
    "dtype": "bf16"
  },
  "points": [
    {"context":1024,"ms":1.5},
    {"context":4096,"ms":null}
  ],
  "wall_time_s": 3.0,
  "empty": {}
}"""


def test_it_reads_back_as_json_writes_it_keys_json_writes_as_text_included():
    value = {"tasks": {1: {"x": 0.1}, False: [], None: [None, "é"], 2.5: {"y": [1, {"z": 2}]}}, "list": [[1, [2]], []]}
    for levels in (0, 1, 2, 3):
        assert json.loads(compact_json(value, levels)) == json.loads(json.dumps(value))
    assert compact_json(value, 0) == json.dumps(value, separators=(",", ":"))


def test_values_json_has_no_form_for_go_through_default_and_nan_stays_nan():
    text = compact_json({"path": {"model": object.__new__(type("Spec", (), {"__str__": lambda self: "spec"}))},
                         "nan": float("nan")}, default=str)
    assert json.loads(text)["path"] == {"model": "spec"} and math.isnan(json.loads(text)["nan"])
