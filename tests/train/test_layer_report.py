"""The figure of a run's layer scores: one panel per score, the kept layers red, and its command's errors."""

import json

import pytest
from matplotlib.colors import to_rgba

from linearize.train.layer_report import OTHER, PICKED, layer_figure, main

KL_RECORD = {"mse": {"0": 0.02, "1": 0.05, "2": 0.01}, "softmax_by": "kl:1", "kl_all_linear": 0.3,
             "kl_restored": {"0": 0.25, "1": 0.31, "2": 0.29}, "kl_gain": {"0": 0.05, "1": -0.01, "2": 0.01},
             "kl_train_steps": 10, "kl_seconds": 1.0, "picked": [0]}


def bars(ax):
    return [(patch.get_height(), patch.get_facecolor()) for patch in ax.patches]


def test_a_kl_record_draws_its_error_and_its_gain_the_kept_layer_red():
    fig = layer_figure(KL_RECORD)
    mse, gain = fig.axes
    red, gray = to_rgba(PICKED), to_rgba(OTHER)
    assert bars(mse) == [(0.02, red), (0.05, gray), (0.01, gray)]
    assert bars(gain) == [(0.05, red), (-0.01, gray), (0.01, gray)]
    assert "10 steps" in gain.get_title() and fig.get_suptitle() == "kl:1: the layer kept softmax in red"
    assert [label.get_text() for label in gain.get_xticklabels()] == ["0", "1", "2"]


def test_an_even_record_labels_the_layers_softmax_from_the_start():
    # even:1 kept layer 1 softmax through stage 1: it has no error, only its red label.
    fig = layer_figure({"mse": {"0": 0.02, "2": 0.01}, "softmax_by": "even:1", "picked": [1]})
    [ax] = fig.axes
    heights = [h for h, _ in bars(ax)]
    assert heights[0] == 0.02 and heights[2] == 0.01 and heights[1] != heights[1]  # NaN: no bar
    labels = ax.get_xticklabels()
    assert [label.get_text() for label in labels] == ["0", "1", "2"]
    assert to_rgba(labels[1].get_color()) == to_rgba(PICKED) and to_rgba(labels[0].get_color()) == to_rgba("black")


def test_the_command_draws_each_record_beside_it(tmp_path, capsys):
    record = tmp_path / "stage1_layer_errors.json"
    record.write_text(json.dumps(KL_RECORD))
    assert main([str(record)]) == 0
    png = tmp_path / "stage1_layer_errors.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage1_layer_errors.json", "stage1_layer_errors.png"]


@pytest.mark.parametrize("content, message", [
    ("{", "not a readable stage1_layer_errors.json of `linearize distill` (JSONDecodeError)"),
    ("[]", "(no mse)"),
    (json.dumps({"mse": {"0": "high"}}), "(mse is not a layer-to-number mapping)"),
    (json.dumps({"mse": {"x": 0.1}}), "(mse is not a layer-to-number mapping)"),
    (json.dumps({"mse": {"0": 0.1}, "kl_gain": [0.1]}), "(kl_gain is not a layer-to-number mapping)"),
    (json.dumps({"mse": {"0": 0.1}, "picked": ["0"]}), "(picked is not a list of layers)"),
])
def test_a_bad_record_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, content, message):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(KL_RECORD))
    bad.write_text(content)
    with pytest.raises(SystemExit) as exit:
        main([str(good), str(bad)])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*.png"))  # every record is read before any figure is drawn
