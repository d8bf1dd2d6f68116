"""experiments/serve/rows_step.py on a tiny random model on the CPU: rows of one prefilled prompt step
together, timed and profiled, for the hybrid and the teacher."""

import pytest

from experiments.serve import rows_step

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256}


@pytest.mark.parametrize("teacher", [False, True])
def test_rows_step_times_each_row_count_and_profiles_the_largest(tmp_path, teacher):
    import torch

    model = rows_step.model_for("smollm2", teacher, 1, torch.device("cpu"), torch.float32, **TINY)
    layers = model.config.linearize["softmax_layers"] if not teacher else None
    assert teacher or layers == [1]
    results = rows_step.run(model, [1, 3], context=40, steps=2, out=tmp_path)
    assert [rows for rows, _ in results] == [1, 3] and all(ms > 0 for _, ms in results)
    assert "Self CPU" in (tmp_path / "profile-rows-3.txt").read_text()
    text = rows_step.table(results, "tiny")
    assert "| 1 |" in text and "| 3 |" in text and "1.00" in text
