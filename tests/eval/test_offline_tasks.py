"""lm-eval tasks beyond the zero-shot suite read the olmo copies offline; a task with no copy is
refused at once where the hub cannot be reached."""

import pytest
from conftest import save

from linearize.eval import harness, local_tasks


@pytest.fixture(scope="module")
def full_manager():
    return harness.task_manager(full_index=True)


@pytest.mark.slow
def test_boolq_reads_the_olmo_copy_with_superglue_labels(full_manager, tmp_path):
    rows = [{"question": "is the sea wet", "answer": True, "passage": "The sea is water."},
            {"question": "is fire cold", "answer": False, "passage": "Fire is hot."}]
    save(rows, tmp_path / "boolq/none/validation")
    sources = local_tasks.redirect_to_local(full_manager, ["boolq"], tmp_path)
    assert sources == {"boolq": {"source": "local", "split": "validation"}}
    cfg = full_manager.task_index["boolq"].cfg
    docs = cfg["custom_dataset"](**cfg["dataset_kwargs"])["validation"]
    # lm-eval's boolq reads `label` against the choices ["no", "yes"]: 1 is yes.
    assert docs["label"] == [1, 0] and docs["question"] == ["is the sea wet", "is fire cold"]


@pytest.mark.slow
@pytest.mark.parametrize("task,folder", [
    ("openbookqa", "openbookqa/main"), ("sciq", "sciq/none"), ("social_iqa", "social_i_qa/none"),
    ("copa", "super_glue/copa"), ("cb", "super_glue/cb"), ("rte", "glue/rte"), ("sst2", "glue/sst2"),
])
def test_each_task_points_at_its_olmo_folder(full_manager, tmp_path, task, folder):
    save([{"x": "a"}], tmp_path / folder / "validation")
    assert local_tasks.redirect_to_local(full_manager, [task], tmp_path)[task]["source"] == "local"
    assert full_manager.task_index[task].cfg["dataset_kwargs"] == {"local_dir": str(tmp_path / folder)}


def test_a_task_without_a_local_copy_is_refused_when_the_hub_is_out_of_reach(monkeypatch):
    import linearize.hub

    asked = []
    monkeypatch.setattr(linearize.hub, "hub_reachable", lambda: asked.append(1) or False)
    sources = {"piqa": {"source": "local", "split": "validation"}, "triviaqa": {"source": "hub"}}
    with pytest.raises(ValueError, match=r"^triviaqa: no local copy of the data .* cannot be reached$"):
        local_tasks.check_hub_tasks(sources)
    local_tasks.check_hub_tasks({"piqa": sources["piqa"]})  # all local: the hub is not even asked
    assert asked == [1]
    monkeypatch.setattr(linearize.hub, "hub_reachable", lambda: True)
    local_tasks.check_hub_tasks(sources)


@pytest.mark.slow
def test_an_evaluation_refuses_such_a_task_before_any_task_runs(model, tokenizer, fake_olmo, monkeypatch):
    import linearize.hub
    from linearize.eval import api

    monkeypatch.setattr(linearize.hub, "hub_reachable", lambda: False)
    monkeypatch.setattr(api, "perplexity", lambda *a, **k: pytest.fail("ppl ran before the refusal"))
    with pytest.raises(ValueError, match=r"^triviaqa: no local copy of the data"):
        api.evaluate(model, tokenizer, "ppl,piqa,triviaqa", limit=1, data_dir=str(fake_olmo))
