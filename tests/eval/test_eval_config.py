"""`EvalConfig`: an evaluation's settings parsed once where they come in, each bad one named."""

import pytest

from linearize.eval.config import EvalConfig, EvalSettingError
from linearize.eval.tasks import TaskNotInRun
from linearize.recipes import Recipe, RecipeError


def test_settings_are_parsed_in_construction():
    cfg = EvalConfig("ppl,longcontext", lengths="1k,512", depths=50, task_lengths={"passkey": "2k"}, limit=2,
                     samples=5)
    assert cfg.tasks[:2] == ["ppl", "passkey"] and len(cfg.tasks) == 7
    assert cfg.lengths == [512, 1024] and cfg.depths == [50] and cfg.task_lengths == {"passkey": [2048]}
    assert cfg.samples_per_cell == 2 and cfg.harness_batch_size == cfg.batch == 8


@pytest.mark.parametrize("settings, setting, message", [
    ({"tasks": "nope"}, "tasks", "Unknown task 'nope'"),
    ({"tasks": "ppl", "lengths": "5x"}, "lengths", "Bad length '5x'"),
    ({"tasks": "ppl", "depths": "200"}, "depths", "Bad depth '200'"),
    ({"tasks": "ppl", "batch": 0}, "batch", "batch must be a positive integer, got 0"),
    ({"tasks": "ppl", "harness_batch": True}, "harness_batch", "harness_batch must be a positive integer"),
    ({"tasks": "ppl", "chat_template": "yes"}, "chat_template", "chat_template must be true or false"),
])
def test_a_bad_setting_is_named(settings, setting, message):
    with pytest.raises(EvalSettingError, match=message) as error:
        EvalConfig(**settings)
    assert error.value.setting == setting


def test_per_task_settings_for_tasks_not_in_the_run_keep_their_cause():
    with pytest.raises(EvalSettingError) as error:
        EvalConfig("ppl", task_limits={"mmlu": 20})
    assert error.value.setting == "task_limits" and isinstance(error.value.__cause__, TaskNotInRun)


def test_a_recipe_eval_section_becomes_one_eval_config(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: teacher\neval:\n  tasks: ppl,passkey\n  lengths: 64\n  samples: 1\n  set: {}\n")
    cfg = Recipe.load(path).eval_config()
    assert (cfg.tasks, cfg.lengths, cfg.samples) == (["ppl", "passkey"], [64], 1)
    path.write_text("model: teacher\neval:\n  tasks: ppl\n  batch: 0\n")
    with pytest.raises(RecipeError, match=r"r.yaml: eval: batch must be a positive integer, got 0$"):
        Recipe.load(path).check_eval()


def test_evaluate_refuses_settings_beside_a_config():
    from linearize.eval.api import evaluate

    with pytest.raises(TypeError, match="limit given beside an EvalConfig"):
        evaluate(None, None, EvalConfig("ppl"), limit=3)
