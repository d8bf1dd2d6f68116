"""The serving engine: requests in slots give each prompt's offline greedy tokens, whatever runs beside them."""

import asyncio

import pytest
import torch
from tiny_models import METHODS, TINY_OPTIONS, perturb_new_parameters, tiny_teacher

import linearize
from linearize.decode import greedy_decode
from linearize.serve.engine import Engine, EngineStopped, QueueFull, SamplingParams


def student(method="lizard", arch="llama", **options):
    model = linearize.convert(tiny_teacher(arch), method, **{**TINY_OPTIONS[method], **options})
    perturb_new_parameters(model)
    return model


def prompts(count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def offline(model, prompt, n):
    return greedy_decode(model, torch.tensor([prompt]), n, cuda_graph=False)[0].tolist()


async def collect(engine, prompt, params, delay=0.0):
    await asyncio.sleep(delay)
    request = engine.submit(prompt, params)
    return [t async for t in request.tokens()], request.finish_reason


def serve(engine, coroutine):
    engine.start()
    try:
        return asyncio.run(coroutine)
    finally:
        engine.stop()


@pytest.mark.parametrize("method", METHODS)
def test_concurrent_greedy_requests_get_their_offline_tokens(method):
    """Twelve prompts of 1 to 39 tokens through 4 slots, arriving at different times, prefilled in
    chunks of 7 tokens between the running requests' steps: each gets the tokens that greedy
    decoding of it alone gives, and slots are reused as requests finish."""
    model = student(method)
    batch = prompts(12)
    lengths = [3 + i % 5 for i in range(12)]
    expected = [offline(model, p, n) for p, n in zip(batch, lengths)]
    engine = Engine(model, max_batch=4, max_queue=16, prefill_chunk=7, cuda_graph=False)

    async def main():
        return await asyncio.gather(*(collect(engine, p, SamplingParams(max_tokens=n, ignore_eos=True), 0.002 * i)
                                      for i, (p, n) in enumerate(zip(batch, lengths))))

    results = serve(engine, main())
    assert [tokens for tokens, _ in results] == expected
    assert {reason for _, reason in results} == {"length"}
    assert engine.stats()["running"] == 0


def test_gemma_slots_and_a_model_with_softmax_layers_serves_each_request_alone():
    for model in (student("lizard", "gemma3_text"), student("still", "gemma3_text", layers="full")):
        batch = prompts(5, seed=1)
        expected = [offline_uncached(model, p, 6) for p in batch]
        engine = Engine(model, max_batch=3, prefill_chunk=5, cuda_graph=False)
        assert engine.mode == ("serial" if model.config.linearize["layers"] == "full" else "slots")

        async def main(engine=engine, batch=batch):
            return await asyncio.gather(*(collect(engine, p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in batch))

        assert [tokens for tokens, _ in serve(engine, main())] == expected


def offline_uncached(model, prompt, n):
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    return seq[0, len(prompt):].tolist()


def test_eos_stops_a_request_unless_ignored_and_cancel_frees_its_slot():
    model = student()
    prompt = prompts(1, seed=2)[0]
    tokens = offline(model, prompt, 8)
    eos = tokens[3]
    engine = Engine(model, max_batch=1, max_queue=4, cuda_graph=False, eos_token_ids=(eos,))

    async def main():
        stopped = await collect(engine, prompt, SamplingParams(max_tokens=8))
        ignored = await collect(engine, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        request = engine.submit(prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
        got = []
        async for token in request.tokens():
            got.append(token)
            if len(got) == 5:
                request.cancel()
        after = await collect(engine, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        return stopped, ignored, (got, request.finish_reason), after

    stopped, ignored, cancelled, after = serve(engine, main())
    assert stopped == (tokens[: tokens.index(eos)], "stop")
    assert ignored == (tokens, "length")
    assert cancelled[1] == "cancelled" and 5 <= len(cancelled[0]) < 10_000
    assert after == (tokens[:2], "length")  # the one slot came back


def test_a_full_queue_refuses_at_once_and_a_stopped_engine_takes_nothing():
    model = student()
    engine = Engine(model, max_batch=1, max_queue=1, cuda_graph=False)

    async def main():
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        first, second = engine.submit([5, 6], long), engine.submit([7], long)
        with pytest.raises(QueueFull):
            engine.submit([8], long)
        first.cancel()
        second.cancel()
        return [r async for r in first.tokens()], [r async for r in second.tokens()]

    serve(engine, main())

    async def late():
        with pytest.raises(EngineStopped):
            engine.submit([5], SamplingParams(max_tokens=1))

    asyncio.run(late())


def test_sampling_is_seeded_and_top_p_keeps_the_top_token_at_small_p():
    model = student()
    prompt = prompts(1, seed=3)[0]
    engine = Engine(model, max_batch=2, cuda_graph=False)

    async def main():
        hot = SamplingParams(max_tokens=12, temperature=1.5, seed=7, ignore_eos=True)
        a, b = await asyncio.gather(collect(engine, prompt, hot), collect(engine, prompt, hot))
        narrow = await collect(engine, prompt, SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-6, ignore_eos=True))
        return a, b, narrow

    a, b, narrow = serve(engine, main())
    assert a == b
    assert narrow[0] == offline(model, prompt, 6)


def test_requests_whose_event_loop_has_closed_do_not_stop_the_engine():
    """A request's reader may be gone with its event loop (a test's, a server's after shutdown): the
    engine drops what it would have posted and goes on serving others."""
    model = student()
    prompt = prompts(1, seed=4)[0]
    expected = offline(model, prompt, 5)  # before the engine runs: the model is the engine thread's alone then
    engine = Engine(model, max_batch=2, cuda_graph=False)

    async def orphan():
        return engine.submit([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))

    engine.start()
    try:
        request = asyncio.run(orphan())  # its loop closes here, with the request still running
        tokens, reason = asyncio.run(collect(engine, prompt, SamplingParams(max_tokens=5, ignore_eos=True)))
        assert (tokens, reason) == (expected, "length")
        request.cancel()
    finally:
        engine.stop(drain=False)
    assert request.finish_reason in ("cancelled", "length"), request.error
