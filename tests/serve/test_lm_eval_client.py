"""lm-eval's `local-completions` model scoring a multiple-choice task through a real `linearize serve` gets
the accuracy `linearize eval` gets offline for the same model, task, documents and data, and each of its
answer options the log-likelihood one offline forward of the same tokens gives. lm-eval sends its prompts
in batches, several requests at once, as it would to a large server.

The model is a tiny random Lizard, so its accuracy is noise; what is checked is that both paths score the
same requests the same way. Its tokenizer adds a BOS token, as Gemma's and Llama 3's do: lm-eval's own
Hugging Face model keeps the tokenizer's default, its API models add none unless `add_bos_token=True`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from serve_helpers import ROOT, SERVED_NAME, Server

pytestmark = pytest.mark.slow  # two model loads and lm-eval twice: ~40 s on 2 cores

TASK, LIMIT = "arc_easy", 20
BATCH, CONCURRENT = 4, 2  # lm-eval's prompts a request, and requests in flight at once
PREFILL_CHUNK = 16  # ARC's prompts (40 to 200 tokens) prefill in several chunks, each keeping its logits
# acc and acc_norm are means over LIMIT documents, so they can only differ by 1/LIMIT or more: agreeing
# within 0.001 means the same answer picked for every document. The two paths compute the same float32
# log-likelihoods in different orders (a batched, padded forward offline; chunked prefills one prompt at
# a time on the server), which differ by ~1e-5: enough to flip only a tie closer than that between two
# options, which these 20 documents do not have (the second test checks each option's log-likelihood).
ACC_TOLERANCE = 1e-3
LOGLIKELIHOOD_TOLERANCE = 1e-3  # a sum over up to ~30 continuation tokens of ~1e-5 differences


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny Lizard model (new parameters off their init) with a character tokenizer that adds BOS."""
    from tiny_models import TINY_OPTIONS, perturb_new_parameters, tiny_teacher, tiny_tokenizer
    from tokenizers import processors

    import linearize

    model = tiny_teacher()
    linearize.convert(model, "lizard", **TINY_OPTIONS["lizard"])
    perturb_new_parameters(model)
    tokenizer = tiny_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    folder = tmp_path_factory.mktemp("lm-eval") / "tiny-lizard"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def offline(model_folder, tmp_path_factory) -> dict:
    """`linearize eval`'s result for the task, as its results file records it."""
    out = tmp_path_factory.mktemp("offline") / "eval.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "linearize.cli", "eval", "--model", str(model_folder), "--tasks", TASK,
            "--limit", str(LIMIT), "--device", "cpu", "--out", str(out)]
    done = subprocess.run(argv, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())["tasks"][TASK]


@pytest.fixture(scope="module")
def served(model_folder, tmp_path_factory):
    """lm-eval's `local-completions` run of the task against the server, on the data `linearize eval`
    reads (lm-eval's own task, pointed at the local olmo copy), and the lm-eval model it ran."""
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from linearize.eval import harness, local_tasks

    manager = harness.task_manager(full_index=False)
    sources = local_tasks.redirect_to_local(manager, [TASK], local_tasks.olmo_datasets_dir())
    assert sources[TASK]["source"] == "local"
    server = Server(model_folder, tmp_path_factory.mktemp("server") / "server.log", "--device", "cpu",
                    "--max-batch", str(BATCH), "--prefill-chunk", str(PREFILL_CHUNK))
    try:
        lm = LocalCompletionsAPI(model=SERVED_NAME, base_url=f"{server.url}/v1/completions",
                                 tokenizer=str(model_folder), tokenizer_backend="huggingface",
                                 tokenized_requests=True, add_bos_token=True, batch_size=BATCH,
                                 num_concurrent=CONCURRENT, max_retries=1)
        out = simple_evaluate(model=lm, tasks=[TASK], limit=LIMIT, task_manager=manager, log_samples=True,
                              bootstrap_iters=0)
    finally:
        server.close()
    return out, lm


def test_served_accuracy_is_linearize_evals_offline_accuracy(offline, served):
    out, _ = served
    assert offline["num_samples"] == LIMIT and offline["data"] == ["local"]
    assert out["n-samples"][TASK]["effective"] == LIMIT
    for metric in ("acc", "acc_norm"):
        assert out["results"][TASK][f"{metric},none"] == pytest.approx(offline[metric], abs=ACC_TOLERANCE), metric


def test_each_options_served_log_likelihood_is_one_offline_forwards(model_folder, served):
    """Beneath the accuracy: every (context, option) pair lm-eval sent, tokenized as it tokenized it,
    scored by the model loaded offline in one forward pass."""
    from linearize.loading import load_model

    out, lm = served
    model = load_model(model_folder)
    samples = out["samples"][TASK]
    assert len(samples) == LIMIT
    got, want = [], []
    for sample in samples:
        for (context, option), (loglikelihood, _) in zip(sample["arguments"], sample["filtered_resps"], strict=True):
            context_ids, option_ids = lm._encode_pair(context, option)
            assert context_ids[0] == lm.tokenizer.bos_token_id
            ids = torch.tensor([context_ids + option_ids])
            with torch.inference_mode():
                logprobs = torch.log_softmax(model(input_ids=ids).logits[0, len(context_ids) - 1:-1].float(), -1)
            want.append(logprobs.gather(1, torch.tensor(option_ids)[:, None]).sum().item())
            got.append(loglikelihood)
    assert len(got) >= 3 * LIMIT  # ARC-Easy has 3 to 5 options a question
    assert got == pytest.approx(want, abs=LOGLIKELIHOOD_TOLERANCE)
