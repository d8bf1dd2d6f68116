"""A real `linearize serve` process on a tiny Lizard model, driven by the `openai` client and plain HTTP.

Greedy answers under concurrency are token for token what offline greedy decoding gives for each prompt
alone; clients that leave free their slots; bad input never stops the server; a full queue answers
429; SIGTERM lets the running requests finish (new ones get 503) and exits 0; a second Ctrl-C ends them
with an error event and [DONE] and exits 130.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import openai
import pytest
import torch
from serve_helpers import SERVED_NAME, Server

from linearize.decode import greedy_decode
from linearize.loading import load_model, load_tokenizer

PREFILL_CHUNK = 8  # small, so that most prompts prefill in several turns
LONG = 50_000  # tokens a request that is meant to be cut short asks for: minutes of work if it were not
PROMPTS = ["Call me Ishmael.", "It was the best of times", "The whale", "a", "In the beginning",
           "0123456789" * 4, "Some years ago, never mind how long precisely", "To be, or not to be",
           "xyz", "The quick brown fox jumps over the lazy dog", "Hello", "once upon a time", "!?", "Moby Dick",
           "Whenever I find myself growing grim about the mouth", "Q", "abc abc abc", "The sea", "Nantucket",
           "Starbuck and Ahab"]


@pytest.fixture(scope="module")
def server(served_model, tmp_path_factory):
    server = Server(served_model, tmp_path_factory.mktemp("server") / "server.log", "--max-batch", "4",
                    "--max-queue", "64", "--prefill-chunk", str(PREFILL_CHUNK), "--max-prompt-tokens", "200",
                    "--max-completion-tokens", str(LONG))
    yield server
    server.close()


@pytest.fixture(scope="module")
def offline(served_model):
    """Greedy decoding of one prompt alone, as the model's own offline path gives it: (ids, n) -> ids."""
    model, tokenizer = load_model(served_model), load_tokenizer(served_model)

    def greedy(prompt_ids: list[int], n: int) -> list[int]:
        return greedy_decode(model, torch.tensor([prompt_ids]), n, cuda_graph=False)[0].tolist()

    greedy.tokenizer = tokenizer
    return greedy


def openai_client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


async def sse(response: httpx.Response):
    """The JSON events of a server-sent event stream, up to [DONE] (which must come)."""
    async for line in response.aiter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            return
        yield json.loads(line.removeprefix("data: "))
    raise AssertionError("the stream ended without data: [DONE]")


async def complete(server: Server, http: httpx.AsyncClient, oai: openai.AsyncOpenAI, how: str, prompt, n: int) -> str:
    """A greedy completion of exactly n tokens by one of four kinds of client; returns its text."""
    fields = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0}
    extra = {"ignore_eos": True}
    if how == "openai":
        answer = await oai.completions.create(**fields, extra_body=extra)
        assert answer.usage.completion_tokens == n and answer.choices[0].finish_reason == "length"
        return answer.choices[0].text
    if how == "openai-stream":
        stream = await oai.completions.create(**fields, stream=True, stream_options={"include_usage": True},
                                              extra_body=extra)
        text, usage = "", None
        async for chunk in stream:
            text += "".join(choice.text for choice in chunk.choices)
            usage = chunk.usage or usage
        assert usage.completion_tokens == n
        return text
    if how == "http":
        response = await http.post("/v1/completions", json={**fields, **extra})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    async with http.stream("POST", "/v1/completions", json={**fields, **extra, "stream": True}) as response:
        assert response.status_code == 200
        chunks = [chunk async for chunk in sse(response)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    return "".join(chunk["choices"][0]["text"] for chunk in chunks)


async def chat(oai: openai.AsyncOpenAI, content: str, n: int, stream: bool) -> str:
    fields = {"model": SERVED_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": n,
              "temperature": 0, "extra_body": {"ignore_eos": True}}
    if not stream:
        return (await oai.chat.completions.create(**fields)).choices[0].message.content
    return "".join([chunk.choices[0].delta.content or "" async for chunk in await oai.chat.completions.create(
        **fields, stream=True)])


def test_concurrent_greedy_answers_are_offline_greedy_token_for_token(server, offline):
    tokenizer = offline.tokenizer
    kinds = ["openai", "openai-stream", "http", "http-stream"]
    jobs = [(kinds[i % 4], prompt, 6 + 3 * (i % 7)) for i, prompt in enumerate(PROMPTS)]
    jobs.append(("http", tokenizer.encode("token ids in"), 12))  # a prompt given as token ids
    chats = [(f"Tell me about {topic}", 10 + i) for i, topic in enumerate(["whales", "ships", "the sea", "ropes"])]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http, openai_client(server) as oai:
            return await asyncio.gather(*[complete(server, http, oai, how, prompt, n) for how, prompt, n in jobs],
                                        *[chat(oai, content, n, stream=i % 2 == 1)
                                          for i, (content, n) in enumerate(chats)])

    start = time.monotonic()
    answers = asyncio.run(run())
    assert len(answers) == len(jobs) + len(chats) >= 16
    for (how, prompt, n), text in zip(jobs, answers, strict=False):
        ids = prompt if isinstance(prompt, list) else tokenizer.encode(prompt)
        assert tokenizer.encode(text) == offline(ids, n), (how, prompt)
    for (content, n), text in zip(chats, answers[len(jobs):], strict=True):
        templated = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)
        assert tokenizer.encode(text) == offline(tokenizer.encode(templated, add_special_tokens=False), n)
    assert time.monotonic() - start < 60
    assert server.health()["running"] == 0


@pytest.mark.slow
def test_clients_that_leave_free_their_slots_and_others_are_unharmed(server, offline):
    tokenizer = offline.tokenizer
    fields = {"model": SERVED_NAME, "max_tokens": LONG, "temperature": 0, "ignore_eos": True}

    async def leave_a_stream(http: httpx.AsyncClient, prompt: str) -> None:
        async with http.stream("POST", "/v1/completions", json={**fields, "prompt": prompt, "stream": True}) as response:
            events = sse(response)
            for _ in range(3):
                await anext(events)
        # Leaving the block closes the connection mid-stream.

    async def leave_an_openai_stream(oai: openai.AsyncOpenAI, prompt: str) -> None:
        stream = await oai.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=LONG, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()

    async def give_up_waiting(prompt: str) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=1.0) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await impatient.post("/v1/completions", json={**fields, "prompt": prompt})

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http, openai_client(server) as oai:
            leaving = [leave_a_stream(http, "first to go"), leave_a_stream(http, "second"),
                       leave_an_openai_stream(oai, "third"), give_up_waiting("fourth")]
            staying = [complete(server, http, oai, how, prompt, 20)
                       for how, prompt in [("http-stream", "I stay"), ("openai", "me too"), ("http", "and me")]]
            return await asyncio.gather(*leaving, *staying)

    answers = asyncio.run(run())[4:]
    for prompt, text in zip(["I stay", "me too", "and me"], answers, strict=True):
        assert tokenizer.encode(text) == offline(tokenizer.encode(prompt), 20)
    # Uncancelled, the requests that were left would run for minutes.
    server.wait_for(lambda stats: stats["running"] == 0 and stats["waiting"] == 0, timeout=15)


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b'["a list"]', 400),
    ("/v1/completions", json.dumps({"model": SERVED_NAME}).encode(), 400),
    ("/v1/completions", json.dumps({"model": SERVED_NAME, "prompt": "x", "max_tokens": -1}).encode(), 400),
    ("/v1/completions", json.dumps({"model": SERVED_NAME, "prompt": "x", "max_tokens": 10**30}).encode(), 400),
    ("/v1/completions", json.dumps({"model": SERVED_NAME, "prompt": "x" * 201}).encode(), 400),
    ("/v1/completions", json.dumps({"model": SERVED_NAME, "prompt": ""}).encode(), 400),
    ("/v1/completions", json.dumps({"model": SERVED_NAME, "prompt": "x", "n": 3}).encode(), 400),
    ("/v1/completions", json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404),
    ("/v1/chat/completions", json.dumps({"model": SERVED_NAME, "messages": [{"role": "user"}],
                                         "temperature": 9}).encode(), 400),
    ("/v2/anything", b"{}", 404),
]


def test_bad_input_gets_4xx_in_openai_format_and_the_server_keeps_serving(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, body, status in BAD_REQUESTS:
            response = http.post(path, content=body, headers={"content-type": "application/json"})
            assert response.status_code == status, (path, body, response.text)
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:  # not HTTP at all
            raw.sendall(b"\x00\x01garbage\r\n\r\n")
            assert b"400" in raw.recv(1024).split(b"\r\n")[0]
        good = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "still here", "max_tokens": 4,
                                                  "temperature": 0})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] <= 4
    async def unknown_model():
        async with openai_client(server) as oai:
            with pytest.raises(openai.NotFoundError):
                await oai.completions.create(model="nope", prompt="x")

    asyncio.run(unknown_model())
    assert server.process.poll() is None


@pytest.mark.slow
def test_a_full_queue_answers_429_at_once(start_server):
    server = start_server("--max-batch", "1", "--max-queue", "1")
    fields = {"model": SERVED_NAME, "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}

    async def run():
        async with (httpx.AsyncClient(base_url=server.url, timeout=120) as http,
                    http.stream("POST", "/v1/completions", json={**fields, "prompt": "running"}) as running):
            events = sse(running)  # held: a dropped generator would close the stream when collected
            await anext(events)
            async with http.stream("POST", "/v1/completions", json={**fields, "prompt": "waiting"}) as waiting:
                assert waiting.status_code == 200
                await asyncio.to_thread(server.wait_for, lambda s: s["running"] == 1 and s["waiting"] == 1)
                start = time.monotonic()
                refused = await http.post("/v1/completions", json={**fields, "prompt": "one too many"})
                assert time.monotonic() - start < 2
                assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
                async with openai_client(server) as oai:
                    with pytest.raises(openai.RateLimitError):
                        await oai.completions.create(model=SERVED_NAME, prompt="again", max_tokens=2)
        # Both streams are closed now: their places free, and the server takes requests again.
        await asyncio.to_thread(server.wait_for, lambda s: s["running"] == 0 and s["waiting"] == 0)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            again = await http.post("/v1/completions", json={**fields, "prompt": "after", "stream": False,
                                                            "max_tokens": 3})
            assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3

    asyncio.run(run())


@pytest.mark.slow
def test_a_softmax_model_is_served_from_batched_kv_rows(start_server, served_teacher):
    server = start_server("--max-batch", "3", "--prefill-chunk", str(PREFILL_CHUNK), model=served_teacher)
    assert server.health()["mode"] == "kv"
    model, tokenizer = load_model(served_teacher), load_tokenizer(served_teacher)

    def uncached_greedy(ids: list[int], n: int) -> list[int]:
        ids = list(ids)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[-n:]

    jobs = [(how, prompt, 5 + 2 * i) for i, (how, prompt) in enumerate(zip(["http", "http-stream", "openai"] * 2,
                                                                            PROMPTS[:6], strict=True))]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http, openai_client(server) as oai:
            return await asyncio.gather(*[complete(server, http, oai, how, prompt, n) for how, prompt, n in jobs])

    for (_, prompt, n), text in zip(jobs, asyncio.run(run()), strict=True):
        assert tokenizer.encode(text) == uncached_greedy(tokenizer.encode(prompt), n), prompt
    assert server.health()["running"] == 0


@pytest.mark.slow
def test_sigterm_lets_the_running_requests_finish_answers_new_ones_503_then_exits_0(start_server):
    server = start_server("--max-batch", "2")
    n = 1000  # seconds of steps

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            fields = {"model": SERVED_NAME, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            whole = asyncio.create_task(http.post("/v1/completions", json={**fields, "prompt": "whole"}))

            async def streamed() -> tuple[str, str]:
                async with http.stream("POST", "/v1/completions",
                                       json={**fields, "prompt": "streamed", "stream": True}) as response:
                    chunks = [chunk async for chunk in sse(response)]
                return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]

            stream = asyncio.create_task(streamed())
            await asyncio.to_thread(server.wait_for, lambda s: s["running"] == 2)
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient(timeout=5) as late:  # the server still listens, and tells them
                refused = [await late.get(f"{server.url}/health"),
                           await late.post(f"{server.url}/v1/completions", json={**fields, "prompt": "late"})]
            assert [r.status_code for r in refused] == [503, 503]
            assert {r.json()["error"]["code"] for r in refused} == {"shutting_down"}
            assert not whole.done() and not stream.done()
            return await whole, await stream

    whole, (text, reason) = asyncio.run(run())
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == n
    assert whole.json()["choices"][0]["finish_reason"] == "length" and reason == "length"
    assert len(text) == n  # one character a token with this tokenizer
    assert server.process.wait(timeout=30) == 0
    log = server.log.read_text()
    assert "Traceback" not in log and "Application shutdown complete" in log


@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_requests_in_flight_with_an_error_and_exits_130(start_server):
    server = start_server("--max-batch", "2", "--max-completion-tokens", "100000")
    fields = {"model": SERVED_NAME, "max_tokens": 100_000, "temperature": 0, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            async def streamed() -> list[str]:
                async with http.stream("POST", "/v1/completions",
                                       json={**fields, "prompt": "streamed", "stream": True}) as response:
                    return [line async for line in response.aiter_lines() if line]

            stream = asyncio.create_task(streamed())
            whole = asyncio.create_task(http.post("/v1/completions", json={**fields, "prompt": "whole"}))
            await asyncio.to_thread(server.wait_for, lambda s: s["running"] == 2)
            server.process.send_signal(signal.SIGINT)
            await asyncio.sleep(0.5)
            assert not stream.done() and not whole.done()
            server.process.send_signal(signal.SIGINT)
            return await stream, await whole

    lines, whole = asyncio.run(run())
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "shutting_down"
    assert server.process.wait(timeout=30) == 130
    log = server.log.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "stopped by a second SIGINT" in log


@pytest.mark.slow  # a real server over HTTP; tests/serve/test_prefix_cache.py covers the cache fast
def test_a_conversation_restores_its_last_turn_from_the_prefix_cache(start_server, offline):
    """Turns of a conversation as token ids, each the last prompt, its reply and a new message: with blocks of
    8 tokens each later turn restores its last prompt, rounded down to a block, and gets its offline greedy
    tokens; /health and /metrics count the tokens restored, and show the host tier's budget and bytes."""
    server = start_server("--prefix-block", "8", "--prefix-cache-memory", "4MiB", "--prefix-cache-host-memory", "2MiB")
    health = server.health()["prefix_cache"]
    assert health["block"] == 8 and health["host_budget_bytes"] == 2 << 20
    history: list[int] = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for turn in range(3):
            history += [5 + turn + i % 7 for i in range(13)]
            response = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": history, "max_tokens": 5,
                                                          "temperature": 0, "ignore_eos": True})
            reply = offline(history, 5)
            assert offline.tokenizer.encode(response.json()["choices"][0]["text"]) == reply
            history += reply
        metrics = http.get("/metrics").text
    # Prompts of 13, 31 and 49 tokens: the second restores 8, the third 24.
    cache = server.health()["prefix_cache"]
    assert cache["hit_tokens"] == 8 + 24 and cache["query_tokens"] == 13 + 31 + 49 and cache["entries"] > 0
    assert f'linearize:prefix_cache_hits_total{{model_name="{SERVED_NAME}"}} 32' in metrics
    assert f'linearize:prefix_cache_host_bytes{{model_name="{SERVED_NAME}"}} 0' in metrics  # 4MiB held them all
