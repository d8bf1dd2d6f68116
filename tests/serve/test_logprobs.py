"""Log-probabilities over the real engine on a tiny Lizard model: completions' `logprobs` and `echo` (the
prompt's own, as lm-eval's loglikelihood requests ask), chat's `logprobs` and `top_logprobs`, each equal to
the log_softmax of one offline forward of the same tokens, and greedy answers unchanged by asking."""

import asyncio
import json

import pytest
import torch
from fastapi.testclient import TestClient
from serve_helpers import exact_tokenizer
from tiny_models import TINY, tiny_student

from linearize.serve.app import create_app
from linearize.serve.engine import Engine, SamplingParams

NAME = "tiny"
PREFILL_CHUNK = 5  # prompts prefill in several chunks, each keeping its positions' logits
PROMPT = [7, 21, 40, 3, 99, 12, 56, 8, 31, 77, 64, 5, 18]  # 13 tokens: chunks of 5, 5 and 3
TOL = {"rtol": 0, "atol": 2e-4}


@pytest.fixture(scope="module")
def model():
    return tiny_student("lizard")


@pytest.fixture(scope="module")
def tokenizer():
    return exact_tokenizer(TINY["vocab_size"])


@pytest.fixture(scope="module")
def client(model, tokenizer):
    engine = Engine(model, max_batch=2, prefill_chunk=PREFILL_CHUNK, cuda_graph=False)
    engine.start()
    app = create_app(engine, tokenizer, NAME, 200, max_completion_tokens=64)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def offline_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of one uncached forward: row i scores token i + 1."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def complete(client, **fields):
    response = client.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "temperature": 0,
                                                   "ignore_eos": True, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def assert_top_matches(top: dict[str, float], row: torch.Tensor, chosen: int, k: int, tokenizer):
    """`top`: the k likeliest tokens' texts (and the chosen one's, if not among them), likeliest first."""
    values, ids = row.topk(k)
    expected = {tokenizer.decode([i]): v for i, v in zip(ids.tolist(), values.tolist())}
    expected.setdefault(tokenizer.decode([chosen]), row[chosen].item())
    assert list(top) == list(expected)
    assert torch.allclose(torch.tensor(list(top.values())), torch.tensor(list(expected.values())), **TOL)
    assert list(top.values()) == sorted(top.values(), reverse=True)


def test_completion_logprobs_are_the_offline_log_softmax_of_the_tokens(client, model, tokenizer):
    choice = complete(client, max_tokens=6, logprobs=3)
    logprobs = choice["logprobs"]
    generated = tokenizer.encode(choice["text"], add_special_tokens=False)
    assert len(generated) == 6 and logprobs["tokens"] == [tokenizer.decode([t]) for t in generated]
    rows = offline_logprobs(model, PROMPT + generated)[len(PROMPT) - 1:-1]
    assert generated == rows.argmax(-1).tolist()  # greedy
    expected = rows.gather(1, torch.tensor(generated)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs["token_logprobs"]), expected, **TOL)
    for top, row, token in zip(logprobs["top_logprobs"], rows, generated):
        assert len(top) == 3  # greedy: the chosen token is the likeliest
        assert_top_matches(top, row, token, 3, tokenizer)
    assert logprobs["text_offset"] == list(range(6))  # one character a token


def test_sampled_tokens_get_the_raw_distributions_logprobs_not_the_tempered_one(client, model, tokenizer):
    choice = complete(client, max_tokens=8, logprobs=2, temperature=1.9, seed=3)
    generated = tokenizer.encode(choice["text"], add_special_tokens=False)
    rows = offline_logprobs(model, PROMPT + generated)[len(PROMPT) - 1:-1]
    expected = rows.gather(1, torch.tensor(generated)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(choice["logprobs"]["token_logprobs"]), expected, **TOL)
    assert rows.argmax(-1).tolist() != generated  # it did sample off the top token somewhere
    for top, row, token in zip(choice["logprobs"]["top_logprobs"], rows, generated):
        assert len(top) in (2, 3)
        assert_top_matches(top, row, token, 2, tokenizer)


def test_echo_with_no_tokens_scores_the_prompt_as_offline(client, model, tokenizer):
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 0."""
    choice = complete(client, max_tokens=0, logprobs=1, echo=True)
    assert choice["text"] == tokenizer.decode(PROMPT) and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in PROMPT]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    rows = offline_logprobs(model, PROMPT)[:-1]
    expected = rows.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs["token_logprobs"][1:]), expected, **TOL)
    for top, row, token in zip(logprobs["top_logprobs"][1:], rows, PROMPT[1:]):
        assert_top_matches(top, row, token, 1, tokenizer)


def test_echo_puts_the_prompt_before_the_text_and_its_logprobs_before_the_tokens(client, model, tokenizer):
    plain = complete(client, max_tokens=4)
    choice = complete(client, max_tokens=4, logprobs=0, echo=True)
    assert choice["text"] == tokenizer.decode(PROMPT) + plain["text"]  # greedy: the same answer
    generated = tokenizer.encode(plain["text"], add_special_tokens=False)
    tokens = PROMPT + generated
    rows = offline_logprobs(model, tokens)[:-1]
    expected = rows.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(choice["logprobs"]["token_logprobs"][1:]), expected, **TOL)
    # logprobs 0: each entry holds the chosen token's alone.
    assert [list(top) for top in choice["logprobs"]["top_logprobs"][1:]] == [[tokenizer.decode([t])] for t in tokens[1:]]
    streamed = client.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": 4,
                                                    "ignore_eos": True, "echo": True, "stream": True})
    assert streamed.status_code == 200
    events = [json.loads(line.removeprefix("data: ")) for line in streamed.text.split("\n\n")
              if line and line != "data: [DONE]"]
    texts = [event["choices"][0]["text"] for event in events]
    assert texts[0] == tokenizer.decode(PROMPT) and "".join(texts) == choice["text"]  # the prompt's event first


def test_lm_evals_local_completions_request_is_answered_in_the_shape_it_parses(client, model):
    """The body lm-eval's `local-completions` sends for a loglikelihood (a batch of one list of token ids,
    max_tokens 1), read back by its own parser: the continuation's log-likelihood and whether it is greedy."""
    completions = pytest.importorskip("lm_eval.models.openai_completions")
    api = completions.LocalCompletionsAPI.__new__(completions.LocalCompletionsAPI)
    api.model = NAME
    context, continuation = PROMPT[:9], PROMPT[9:]
    body = api._create_payload([context + continuation], generate=False)
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    [(loglikelihood, greedy)] = completions.LocalCompletionsAPI.parse_logprobs(response.json(), ctxlens=[len(context)])
    rows = offline_logprobs(model, PROMPT)[len(context) - 1:-1]
    assert loglikelihood == pytest.approx(rows.gather(1, torch.tensor(continuation)[:, None]).sum().item(), abs=1e-3)
    assert greedy == (rows.argmax(-1).tolist() == continuation)


def test_lm_evals_batch_of_loglikelihood_requests_gets_one_choice_each_in_order(client, model):
    """lm-eval's `batch_size` > 1: several token lists in one body, each choice scored as the prompt alone
    (lm-eval matches them to its requests by `index`)."""
    completions = pytest.importorskip("lm_eval.models.openai_completions")
    api = completions.LocalCompletionsAPI.__new__(completions.LocalCompletionsAPI)
    api.model = NAME
    pairs = [(PROMPT[:9], PROMPT[9:]), (PROMPT[:3], PROMPT[3:5]), (PROMPT[4:12], PROMPT[12:])]
    body = api._create_payload([context + continuation for context, continuation in pairs], generate=False)
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert [choice["index"] for choice in response.json()["choices"]] == [0, 1, 2]
    answers = completions.LocalCompletionsAPI.parse_logprobs(response.json(), ctxlens=[len(c) for c, _ in pairs])
    for (context, continuation), (loglikelihood, _) in zip(pairs, answers, strict=True):
        rows = offline_logprobs(model, context + continuation)[len(context) - 1:-1]
        assert loglikelihood == pytest.approx(rows.gather(1, torch.tensor(continuation)[:, None]).sum().item(), abs=1e-3)


def test_chat_logprobs_give_each_token_and_its_top_alternatives(client, model, tokenizer):
    messages = [{"role": "user", "content": "Hello there"}]
    response = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "temperature": 0,
                                                         "max_tokens": 5, "ignore_eos": True, "logprobs": True,
                                                         "top_logprobs": 4})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    content = choice["logprobs"]["content"]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    generated = tokenizer.encode(choice["message"]["content"], add_special_tokens=False)
    assert [entry["token"] for entry in content] == [tokenizer.decode([t]) for t in generated]
    rows = offline_logprobs(model, prompt + generated)[len(prompt) - 1:-1]
    for entry, row, token in zip(content, rows, generated, strict=True):
        assert entry["logprob"] == pytest.approx(row[token].item(), abs=2e-4)
        assert entry["bytes"] == list(entry["token"].encode())
        values, ids = row.topk(4)
        assert [t["token"] for t in entry["top_logprobs"]] == [tokenizer.decode([i]) for i in ids.tolist()]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(values.tolist(), abs=2e-4)
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy
    plain = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "temperature": 0,
                                                      "max_tokens": 5, "ignore_eos": True}).json()["choices"][0]
    assert plain["logprobs"] is None and plain["message"] == choice["message"]


@pytest.mark.parametrize("static", [False, True], ids=["own-caches", "static-prefill"])
def test_asking_for_logprobs_leaves_greedy_tokens_alone_and_prompt_logprobs_match_offline(model, static):
    """Requests with and without log-probabilities side by side, through either prefill path: every one
    gets its offline greedy tokens, and the prompt's log-probabilities are the offline forward's."""
    engine = Engine(model, max_batch=2, prefill_chunk=4, cuda_graph=False, static_prefill=static)
    asks = [None, 2, 0, None]

    async def one(k, delay):
        await asyncio.sleep(delay)
        request = engine.submit(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=k, prompt_logprobs=k))
        return [t async for t in request.tokens()], request

    async def main():
        return await asyncio.gather(*(one(k, 0.002 * i) for i, k in enumerate(asks)))

    engine.start()
    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    rows = offline_logprobs(model, PROMPT + results[0][0])
    assert all(tokens == rows[len(PROMPT) - 1:-1].argmax(-1).tolist() for tokens, _ in results)
    for k, (tokens, request) in zip(asks, results):
        if k is None:
            assert request.logprobs == [] and request.prompt_logprobs == []
            continue
        assert request.prompt_logprobs[0] is None and len(request.prompt_logprobs) == len(PROMPT)
        scored = request.prompt_logprobs[1:] + request.logprobs
        assert [e.token for e in scored] == PROMPT[1:] + tokens
        expected = rows[:-1].gather(1, torch.tensor(PROMPT[1:] + tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([e.logprob for e in scored]), expected, **TOL)
        assert all(len(e.top) == k for e in scored)
