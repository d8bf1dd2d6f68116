"""The web layer over a scripted engine: OpenAI's bodies, streaming, stop strings, and every error in OpenAI's format."""

import json

import pytest
from fastapi.testclient import TestClient
from serve_helpers import CHAT_TEMPLATE, ScriptedEngine, byte_tokenizer
from tiny_models import tiny_tokenizer

from linearize.serve.app import COMPLETIONS_DEFAULT_MAX_TOKENS, create_app
from linearize.serve.engine import EngineStopped, QueueFull

NAME = "tiny"
REPLY = "Hello, world! How are you?"
MAX_PROMPT = 60
MAX_COMPLETION = 64


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture
def engine(tokenizer):
    return ScriptedEngine(tokenizer.encode(REPLY, add_special_tokens=False))


@pytest.fixture
def client(engine, tokenizer):
    app = create_app(engine, tokenizer, NAME, MAX_PROMPT, max_completion_tokens=MAX_COMPLETION)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def complete(client, **fields):
    return client.post("/v1/completions", json={"model": NAME, "prompt": "Say hi", "temperature": 0, **fields})


def chat(client, **fields):
    messages = [{"role": "user", "content": "Say hi"}]
    return client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, **fields})


def events(response) -> list:
    """The data of each server-sent event; the last must be [DONE]."""
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "\n" not in body["error"]["message"]
    return body["error"]


# ----------------------------------------------------------------------------------------------------
# Answers


def test_completion_returns_the_text_usage_and_finish_reason(client, engine, tokenizer):
    response = complete(client, max_tokens=40)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == NAME and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}]
    prompt_tokens = len(tokenizer.encode("Say hi"))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": len(REPLY),
                             "total_tokens": prompt_tokens + len(REPLY)}
    (request,) = engine.requests
    assert request.prompt_ids == tokenizer.encode("Say hi")
    assert request.params.max_tokens == 40 and request.params.temperature == 0


def test_completion_defaults_to_sixteen_tokens_as_openai(client, engine):
    body = complete(client).json()
    assert engine.requests[0].params.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    assert body["choices"][0]["text"] == REPLY[:16] and body["choices"][0]["finish_reason"] == "length"


def test_sampling_fields_reach_the_engine(client, engine):
    assert complete(client, temperature=0.7, top_p=0.9, seed=1234, ignore_eos=True, max_tokens=5).status_code == 200
    params = engine.requests[0].params
    assert (params.temperature, params.top_p, params.seed, params.ignore_eos, params.max_tokens) == (0.7, 0.9, 1234,
                                                                                                     True, 5)


@pytest.mark.parametrize("prompt", ["list of one", "tokens", "list of one list of tokens"])
def test_a_prompt_can_be_a_list_of_one_string_or_token_ids(client, engine, tokenizer, prompt):
    ids = tokenizer.encode("Say hi")
    response = complete(client, prompt={"list of one": ["Say hi"], "tokens": ids, "list of one list of tokens": [ids]}[prompt])
    assert response.status_code == 200
    assert engine.requests[0].prompt_ids == ids


def test_a_batch_of_prompts_gets_one_choice_each_in_order_and_their_usage_summed(client, engine, tokenizer):
    ids = tokenizer.encode("Go on")
    response = complete(client, prompt=["Say hi", ids, "Third"], max_tokens=5, echo=True)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    assert [choice["text"] for choice in body["choices"]] == [p + REPLY[:5] for p in ("Say hi", "Go on", "Third")]
    assert all(choice["finish_reason"] == "length" for choice in body["choices"])
    assert [r.prompt_ids for r in engine.requests] == [tokenizer.encode(p) for p in ("Say hi", "Go on", "Third")]
    prompt_tokens = sum(len(r.prompt_ids) for r in engine.requests)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 15,
                             "total_tokens": prompt_tokens + 15}


def test_a_refused_prompt_of_a_batch_cancels_the_ones_submitted_before_it(client, engine, monkeypatch):
    submit = engine.submit

    def refuse_the_second(prompt_ids, params):
        if engine.requests:
            raise QueueFull("all 4 slots are busy")
        return submit(prompt_ids, params)

    monkeypatch.setattr(engine, "submit", refuse_the_second)
    assert error_of(complete(client, prompt=["Say hi", "again", "and again"]), 429)["code"] == "queue_full"
    assert len(engine.requests) == 1 and engine.requests[0].cancelled


def test_an_engine_failure_on_a_batch_is_a_500_once_every_prompt_ended(client, engine):
    engine.fail_after = 3
    error = error_of(complete(client, prompt=["Say hi", "again"]), 500)
    assert "the step failed" in error["message"]
    assert [r.finish_reason for r in engine.requests] == ["error", "error"]
    engine.fail_after = None


def test_a_stop_string_cuts_the_text_and_frees_the_slot(client, engine):
    body = complete(client, max_tokens=40, stop=["How", "!"]).json()
    assert body["choices"][0]["text"] == "Hello, world" and body["choices"][0]["finish_reason"] == "stop"
    assert engine.requests[0].cancelled
    assert body["usage"]["completion_tokens"] == len("Hello, world!")


def test_streamed_completion_adds_up_to_the_whole_one(client):
    response = complete(client, max_tokens=40, stream=True, stop="you")
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = events(response)
    assert all(c["object"] == "text_completion" and len({c["id"] for c in chunks}) == 1 for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world! How are "
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_streamed_usage_comes_last_when_asked(client):
    chunks = events(complete(client, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_applies_the_template_and_answers_as_assistant(client, engine, tokenizer):
    body = chat(client, max_tokens=40, temperature=0).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"
    templated = "<user>Say hi|<assistant>"
    assert engine.requests[0].prompt_ids == tokenizer.encode(templated, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(templated)


def test_chat_takes_text_parts_and_max_completion_tokens(client, engine, tokenizer):
    messages = [{"role": "system", "content": "Be brief"},
                {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}]
    response = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages,
                                                           "max_completion_tokens": 3})
    assert response.json()["choices"][0]["message"]["content"] == REPLY[:3]
    assert engine.requests[0].prompt_ids == tokenizer.encode("<system>Be brief|<user>Say hi|<assistant>",
                                                             add_special_tokens=False)


def test_chat_without_max_tokens_gets_the_server_cap(client, engine):
    chat(client)
    assert engine.requests[0].params.max_tokens == MAX_COMPLETION


def test_streamed_chat_sends_the_role_then_the_content_then_the_reason(client):
    chunks = events(chat(client, max_tokens=5, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY[:5]
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_streamed_text_never_splits_a_character():
    tok = byte_tokenizer()
    reply = "naïve 🐋 €5"
    app = create_app(ScriptedEngine(tok.encode(reply, add_special_tokens=False)), tok, NAME, MAX_PROMPT)
    with TestClient(app) as client:
        chunks = events(complete(client, max_tokens=40, stream=True))
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == reply and not any("\ufffd" in t for t in texts)


def test_models_and_health(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == NAME
    assert client.get("/health").json() == {"status": "ok", "running": 0, "waiting": 0, "slots": 4, "mode": "slots",
                                            "prefix_cache": {"enabled": True, "entries": 0, "bytes": 0,
                                                             "query_tokens": 0, "hit_tokens": 0}}


def test_shutdown_drains_the_engine(engine, tokenizer):
    app = create_app(engine, tokenizer, NAME, MAX_PROMPT)
    with TestClient(app):
        assert engine.stopped_with == [] and not app.state.engine_stopped
    assert engine.stopped_with == [True] and app.state.engine_stopped


# ----------------------------------------------------------------------------------------------------
# Errors


BAD_COMPLETIONS = [
    ({"prompt": "hi"}, "model"),  # no model
    ({"model": NAME}, "prompt"),
    ({"model": NAME, "prompt": 5}, "prompt"),
    ({"model": NAME, "prompt": ""}, "prompt"),
    ({"model": NAME, "prompt": []}, "prompt"),
    ({"model": NAME, "prompt": ["a", 7]}, "prompt"),
    ({"model": NAME, "prompt": [1, "a"]}, "prompt"),
    ({"model": NAME, "prompt": [5, 1000]}, "prompt"),  # not in the vocabulary
    ({"model": NAME, "prompt": [-1]}, "prompt"),
    ({"model": NAME, "prompt": "x" * (MAX_PROMPT + 1)}, "prompt"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": MAX_COMPLETION + 1}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"model": NAME, "prompt": "hi", "temperature": -0.1}, "temperature"),
    ({"model": NAME, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": NAME, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": NAME, "prompt": "hi", "n": 2}, "n"),
    ({"model": NAME, "prompt": "hi", "seed": 2**64}, "seed"),
    ({"model": NAME, "prompt": "hi", "seed": "1"}, "seed"),
    ({"model": NAME, "prompt": "hi", "stop": 5}, "stop"),
    ({"model": NAME, "prompt": "hi", "stop": [""]}, "stop"),
    ({"model": NAME, "prompt": "hi", "stop": ["a"] * 17}, "stop"),
    ({"model": NAME, "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": NAME, "prompt": [[5], []]}, "prompt"),
    ({"model": NAME, "prompt": [[5], ["6"]]}, "prompt"),
    ({"model": NAME, "prompt": [[5], [-1]]}, "prompt"),  # nothing submitted, not even the first
    ({"model": NAME, "prompt": [[5], [6]], "stream": True}, "stream"),
    ({"model": NAME, "prompt": "hi", "logprobs": 21}, "logprobs"),  # vLLM's bound: 20
    ({"model": NAME, "prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"model": NAME, "prompt": "hi", "logprobs": True}, "logprobs"),
    ({"model": NAME, "prompt": "hi", "logprobs": 1, "stream": True}, "logprobs"),
    ({"model": NAME, "prompt": "hi", "echo": "yes"}, "echo"),
    ({"model": NAME, "prompt": "hi", "top_logprobs": 2}, "top_logprobs"),  # chat's, not completions'
    ({"model": NAME, "prompt": "hi", "max_tokens": 0, "logprobs": 1}, "max_tokens"),  # 0 only with echo
    ({"model": NAME, "prompt": "hi", "best_of": 3}, "best_of"),
    ({"model": 7, "prompt": "hi"}, "model"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_requests_get_400_naming_the_field(client, engine, body, param):
    error = error_of(client.post("/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert engine.requests == []
    assert complete(client).status_code == 200  # and the next request is served


BAD_CHATS = [
    ({"model": NAME}, "messages"),
    ({"model": NAME, "messages": []}, "messages"),
    ({"model": NAME, "messages": "hi"}, "messages"),
    ({"model": NAME, "messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"model": NAME, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, "max_tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "stream": True}, "logprobs"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD_CHATS)])
def test_bad_chat_requests_get_400_naming_the_field(client, body, param):
    error = error_of(client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param


@pytest.mark.parametrize(("content", "type_"), [(b"{bad json", "application/json"), (b"[1, 2]", "application/json"),
                                                (b"", "application/json"), (b"prompt=hi", "text/plain")])
def test_bodies_that_are_not_a_json_object_get_400(client, content, type_):
    error = error_of(client.post("/v1/completions", content=content, headers={"content-type": type_}), 400)
    assert error["type"] == "invalid_request_error"


def test_an_unknown_model_gets_404_in_openai_format(client):
    error = error_of(complete(client, model="gpt-4"), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-4" in error["message"]


def test_unknown_paths_and_methods_get_errors_in_openai_format(client):
    assert error_of(client.get("/v1/nothing"), 404)["message"] == "Invalid URL (GET /v1/nothing)"
    error_of(client.get("/v1/completions"), 405)


def test_chat_with_a_tokenizer_without_template_gets_400(engine):
    app = create_app(engine, tiny_tokenizer(), NAME, MAX_PROMPT)
    with TestClient(app) as client:
        error = error_of(chat(client), 400)
    assert "chat template" in error["message"] and engine.requests == []


def test_a_template_that_refuses_the_messages_gets_400(engine, tokenizer):
    refusing = tiny_tokenizer()
    refusing.chat_template = "{{ raise_exception('roles must alternate') }}"
    with TestClient(create_app(engine, refusing, NAME, MAX_PROMPT)) as client:
        assert "roles must alternate" in error_of(chat(client), 400)["message"]


@pytest.mark.parametrize(("refusal", "status", "code"), [(QueueFull("all 4 slots are busy"), 429, "queue_full"),
                                                         (EngineStopped("the server is shutting down"), 503,
                                                          "shutting_down")])
def test_a_full_queue_gets_429_and_a_stopping_engine_503(client, engine, refusal, status, code):
    engine.refuse = refusal
    for stream in (False, True):
        error = error_of(complete(client, stream=stream), status)
        assert error["code"] == code
    engine.refuse = None
    assert complete(client).status_code == 200


def test_an_engine_failure_is_a_500_then_the_server_goes_on(client, engine):
    engine.fail_after = 3
    error = error_of(complete(client), 500)
    assert error["type"] == "server_error" and "the step failed" in error["message"]
    engine.fail_after = None
    assert complete(client).status_code == 200


def test_an_engine_failure_mid_stream_ends_it_with_an_error_event(client, engine):
    engine.fail_after = 3
    chunks = events(complete(client, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == REPLY[:3]
    assert chunks[-1]["error"]["type"] == "server_error"


def test_an_unexpected_exception_is_a_500_in_openai_format(engine, tokenizer):
    class Broken:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __len__(self):
            return len(tokenizer)

        def encode(self, *args, **kwargs):
            raise KeyError("boom")

    app = create_app(engine, Broken(), NAME, MAX_PROMPT)
    with TestClient(app, raise_server_exceptions=False) as client:
        error = error_of(complete(client), 500)
        assert error["type"] == "server_error" and "KeyError" in error["message"]
        assert complete(client, prompt=tokenizer.encode("hi")).status_code == 200


# ----------------------------------------------------------------------------------------------------
# Text that is no Unicode, prompts too large to tokenize, and stopping


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", '{"model": "tiny", "prompt": "caf\\udce9 ok"}', "prompt"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d hi"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", ('{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                              '"text": "a\\udfff"}]}]}'), "messages.0.content.0.text"),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}', "stop.0"),
])
def test_a_lone_surrogate_gets_400_naming_the_field(client, engine, path, body, param):
    # JSON's \u escapes can spell half of a UTF-16 pair, which is no text: no tokenizer takes it.
    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    error = error_of(response, 400)
    assert error["param"] == param and "lone UTF-16 surrogate" in error["message"], error
    assert error["message"].startswith(f"{param}: ") and engine.requests == []
    assert complete(client).status_code == 200


class SlowTokenizer:
    """The tiny tokenizer, whose `encode` takes `seconds` and records each text it was given."""

    def __init__(self, tokenizer, seconds: float):
        self.tokenizer, self.seconds, self.encoded = tokenizer, seconds, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __len__(self):
        return len(self.tokenizer)

    def encode(self, text, **kwargs):
        import time

        self.encoded.append(len(text))
        time.sleep(self.seconds)
        return self.tokenizer.encode(text, **kwargs)


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(engine, tokenizer):
    slow = SlowTokenizer(tokenizer, 0.0)
    longest = max(len(t) for t in tokenizer.get_vocab())
    app = create_app(engine, slow, NAME, MAX_PROMPT)
    with TestClient(app) as client:
        error = error_of(complete(client, prompt="x" * (MAX_PROMPT * longest + 1)), 400)
        assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
        assert f"{MAX_PROMPT * longest + 1} characters" in error["message"]
        messages = [{"role": "user", "content": "y" * (MAX_PROMPT * longest)}, {"role": "user", "content": "z"}]
        error = error_of(chat(client, messages=messages), 400)
        assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
        assert slow.encoded == []  # neither reached the tokenizer
        # At the limit it is tokenized, and refused by its tokens.
        assert error_of(complete(client, prompt="x" * (MAX_PROMPT * longest)), 400)["code"] == "context_length_exceeded"
        assert slow.encoded == [MAX_PROMPT * longest]


def test_tokenizing_runs_off_the_event_loop(engine, tokenizer):
    import asyncio
    import time

    import httpx

    slow = SlowTokenizer(tokenizer, 1.5)
    app = create_app(engine, slow, NAME, MAX_PROMPT)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            body = {"model": NAME, "prompt": "Say hi", "temperature": 0}
            completion = asyncio.create_task(http.post("/v1/completions", json=body))
            while not slow.encoded:
                await asyncio.sleep(0.01)
            started = time.perf_counter()
            health = await http.get("/health")
            waited = time.perf_counter() - started
            return (await completion).status_code, health.status_code, waited

    completion, health, waited = asyncio.run(main())
    assert (completion, health) == (200, 200)
    assert waited < 1.0, f"/health waited {waited:.2f} s for the tokenizer"


def test_draining_answers_new_requests_503_and_forcing_ends_streams_with_an_error_and_done(tokenizer):
    import asyncio

    import httpx

    engine = ScriptedEngine(tokenizer.encode(REPLY, add_special_tokens=False) * 50, delay=0.02)
    app = create_app(engine, tokenizer, NAME, MAX_PROMPT)
    shutdown = app.state.shutdown

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            body = {"model": NAME, "prompt": "Say hi", "temperature": 0, "max_tokens": MAX_COMPLETION}
            stream = asyncio.create_task(http.post("/v1/completions", json={**body, "stream": True}))
            whole = asyncio.create_task(http.post("/v1/completions", json=body))
            while len(engine.requests) < 2:
                await asyncio.sleep(0.01)
            shutdown.drain()
            assert shutdown.in_flight == 2 and not shutdown.idle
            late = [await http.post("/v1/completions", json=body), await http.get("/health")]
            shutdown.force()
            return await stream, await whole, late

    stream, whole, late = asyncio.run(main())
    for response in late:
        error = error_of(response, 503)
        assert error["code"] == "shutting_down" and response.headers["connection"] == "close"
    chunks = events(stream)  # ends with [DONE]
    assert chunks[-1]["error"]["code"] == "shutting_down"
    assert error_of(whole, 503)["code"] == "shutting_down"
    assert shutdown.idle and all(r.cancelled for r in engine.requests)
