"""The serving engine: requests in slots (linearized models) or batched KV rows (softmax teachers and
hybrids) give each prompt's offline greedy tokens, whatever runs beside them."""

import asyncio

import pytest
import torch
from tiny_models import ARCHITECTURES, METHODS, tiny_student, tiny_teacher

from linearize.decode import greedy_decode
from linearize.serve import kv_slots
from linearize.serve.engine import MIN_PREFILL_CHUNK, Engine, EngineStopped, QueueFull, SamplingParams, TooLarge


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


@pytest.mark.parametrize("static", [False, True], ids=["own-caches", "static-prefill"])
@pytest.mark.parametrize("method", METHODS)
def test_concurrent_greedy_requests_get_their_offline_tokens(method, static):
    """Twelve prompts of 1 to 39 tokens through 4 slots, arriving at different times, prefilled in
    chunks of 7 tokens (or, through the fixed-shape prefill cache, of 4, 2 and 1) between the running
    requests' steps: each gets the tokens that greedy decoding of it alone gives, and slots are reused
    as requests finish."""
    model = tiny_student(method)
    batch = prompts(12)
    lengths = [3 + i % 5 for i in range(12)]
    expected = [offline(model, p, n) for p, n in zip(batch, lengths)]
    engine = Engine(model, max_batch=4, max_queue=16, prefill_chunk=7, cuda_graph=False, static_prefill=static)

    async def main():
        return await asyncio.gather(*(collect(engine, p, SamplingParams(max_tokens=n, ignore_eos=True), 0.002 * i)
                                      for i, (p, n) in enumerate(zip(batch, lengths))))

    results = serve(engine, main())
    assert [tokens for tokens, _ in results] == expected
    assert {reason for _, reason in results} == {"length"}
    assert engine.stats()["running"] == 0
    # Chunks of 7, or of the largest power of two up to 7 that the prompt's rest holds.
    sizes = [4, 2, 1] if static else [7]
    calls = 0
    for prompt in batch:
        rest = len(prompt)
        while rest:
            rest -= next(size for size in sizes if size <= rest) if static else min(7, rest)
            calls += 1
    assert engine.prefill_calls == calls


class FakeClock:
    """The engine's clock, moved by the model's calls alone: a prefill call `fixed` units plus 1 unit a
    token, a decode step (one token a row) 40 units, so the chunks the engine sizes from its timings are
    known exactly."""

    def __init__(self, model, fixed: float = 0.0):
        self.now = 0.0
        self.fixed = fixed
        self.prefills = []  # the tokens of each prefill call (one prompt, several tokens)
        model.register_forward_pre_hook(self.advance, with_kwargs=True)

    def advance(self, module, args, kwargs):
        length = kwargs["input_ids"].shape[1]
        if length > 1:
            self.prefills.append(length)
        self.now += 40.0 if length == 1 else self.fixed + length

    def perf_counter(self):
        return self.now


def paced_prefills(monkeypatch, budget: float, fixed: float = 0.0) -> tuple[FakeClock, Engine]:
    """A 5-token prompt, then, while it decodes 30 tokens, a 120-token one, on an engine of `budget`
    timed by a FakeClock of `fixed` units a prefill call; asserts each request gets its offline greedy
    tokens, and returns the clock (its prefill calls) and the engine."""
    import linearize.serve.engine as engine_module

    model = tiny_student()
    first, second = prompts(1, seed=5)[0][:5], prompts(1, seed=6)[0] * 120
    first, second = first + [7] * (5 - len(first)), second[:120]
    expected = [offline(model, first, 30), offline(model, second, 3)]
    clock = FakeClock(model, fixed)
    monkeypatch.setattr(engine_module, "time", clock)
    engine = engine_module.Engine(model, max_batch=2, prefill_chunk=128, prefill_budget=budget, cuda_graph=False)

    async def main():
        return await asyncio.gather(collect(engine, first, SamplingParams(max_tokens=30, ignore_eos=True)),
                                    collect(engine, second, SamplingParams(max_tokens=3, ignore_eos=True)))

    assert [tokens for tokens, _ in serve(engine, main())] == expected
    return clock, engine


@pytest.mark.parametrize("budget", [1.0, 0.5, 0.0])
def test_a_prompt_arriving_while_others_decode_is_prefilled_in_chunks_of_the_budget(budget, monkeypatch):
    """While a request decodes (a step: 40 units), a 120-token prompt is prefilled in chunks that take
    `budget` steps at a prefill call's cost (1 unit a token, nothing fixed): 40 tokens at budget 1, 20 at
    0.5, and whole `prefill_chunk`s (128) at 0. The first prompt, with nothing decoding, takes a whole
    chunk. Each request still gets its offline greedy tokens."""
    clock, _ = paced_prefills(monkeypatch, budget)
    chunk = {1.0: 40, 0.5: 20, 0.0: 120}[budget]
    assert clock.prefills == [5] + [chunk] * (120 // chunk)


def test_a_calls_fixed_share_sets_the_fewest_tokens_a_paced_chunk_takes(monkeypatch):
    """A prefill call costing 60 units plus 1 a token, a step 40: no chunk fits a budget of one step, so
    after the first paced chunk (16 tokens: the 5-token call's 13 units a token leave room for the floor
    alone) the fitted cost gives the fixed share's worth, 60 tokens, which keeps most of a call's time on
    its tokens. Each request still gets its offline greedy tokens."""
    clock, engine = paced_prefills(monkeypatch, 1.0, fixed=60.0)
    assert clock.prefills == [5, 16, 60, 44]
    assert engine.prefill_cost.fit() == (60.0, 1.0)


def test_the_static_prefill_cuts_paced_chunks_to_its_sizes_and_is_on_where_it_pays(monkeypatch):
    """Through the fixed-shape prefill cache every prefill call is a power of two up to `prefill_chunk`
    (128), whatever size the budget asks for, and each request still gets its offline greedy tokens. By
    default it is on only for paced prefills with graphed steps (a GPU), and never outside slots mode."""
    import linearize.serve.engine as engine_module

    real = engine_module.Engine

    def static_engine(*args, **kwargs):
        return real(*args, **kwargs, static_prefill=True)

    monkeypatch.setattr(engine_module, "Engine", static_engine)
    clock, engine = paced_prefills(monkeypatch, 1.0)
    assert engine.static_prefill and clock.prefills and engine.prefill_path == "eager"  # a CPU
    assert engine.stats()["prefill"] == "eager"
    assert all(n & (n - 1) == 0 and n <= 128 for n in clock.prefills), clock.prefills
    assert not real(tiny_student(), prefill_budget=1.0, cuda_graph=False).static_prefill  # a CPU
    assert not real(tiny_teacher("llama"), static_prefill=True).static_prefill  # kv mode


def test_prefill_chunks_stay_within_the_floor_and_prefill_chunk():
    engine = Engine(tiny_student(), prefill_chunk=256, prefill_budget=1.0, cuda_graph=False)
    assert engine.prefill_tokens() == 256  # nothing decodes
    engine._running = [object()]
    assert engine.prefill_tokens() == 256  # nothing timed yet
    engine._step_s = 0.040
    engine.prefill_cost.add(100, 0.100)  # one size: its time per token sizes the chunk
    assert engine.prefill_tokens() == 40
    engine._step_s = 1e-6  # a step far faster than a token of prefill: prompts still advance
    assert engine.prefill_tokens() == MIN_PREFILL_CHUNK
    engine._step_s = 10.0
    assert engine.prefill_tokens() == 256
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="prefill_budget must be a finite number >= 0"):
            Engine(tiny_student(), prefill_budget=bad)


def test_a_fully_linearized_gemma_is_served_in_slots():
    model = tiny_student("lizard", "gemma3_text")
    batch = prompts(5, seed=1)
    expected = [offline_uncached(model, p, 6) for p in batch]
    engine = Engine(model, max_batch=3, prefill_chunk=5, cuda_graph=False)
    assert engine.mode == "slots"

    async def main():
        return await asyncio.gather(*(collect(engine, p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in batch))

    assert [tokens for tokens, _ in serve(engine, main())] == expected


def offline_uncached(model, prompt, n):
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    return seq[0, len(prompt):].tolist()


def test_eos_stops_a_request_unless_ignored_and_cancel_frees_its_slot():
    model = tiny_student()
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
    model = tiny_student()
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
    model = tiny_student()
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
    model = tiny_student()
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


# The kv mode: softmax teachers, their requests' keys and values in the rows of one BatchedKVCache.

def greedy_batch(engine, batch, lengths):
    """Each prompt's (tokens, finish reason) for `n` greedy tokens past any end of sequence, the requests
    submitted 3 ms apart so that they join a batch already running."""

    async def main():
        return await asyncio.gather(*(collect(engine, p, SamplingParams(max_tokens=n, ignore_eos=True), 0.003 * i)
                                      for i, (p, n) in enumerate(zip(batch, lengths))))

    return serve(engine, main())


def teacher_greedy(model, prompt, n):
    """HF's own greedy generation of `prompt` alone, n tokens past any end-of-sequence token."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


async def collect_or_error(engine, prompt, params, delay=0.0):
    """Like `collect`, with an engine error as (tokens so far, "error", message)."""
    await asyncio.sleep(delay)
    request = engine.submit(prompt, params)
    tokens = []
    try:
        async for token in request.tokens():
            tokens.append(token)
    except RuntimeError as e:
        return tokens, request.finish_reason, str(e)
    return tokens, request.finish_reason, None


def watch_kv_allocations(engine) -> list[int]:
    """The bytes of every buffer reallocation of the engine's BatchedKVCache, as they happen."""
    sizes, reallocate = [], engine._rows.cache._reallocate

    def watched(rows, capacity):
        reallocate(rows, capacity)
        sizes.append(engine._rows.cache.nbytes)

    engine._rows.cache._reallocate = watched
    return sizes


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_softmax_teachers_batch_their_requests_and_give_each_its_offline_greedy_tokens(arch):
    """Ten prompts of 1 to 39 tokens (past Gemma's window of 6, so the sliding masks matter; Gemma 2 on
    eager attention with its logit cap), 3 to 9 tokens each, through 4 rows, arriving at different times
    and prefilled in chunks of 7 between the running requests' steps: each gets what HF's greedy
    generation of it alone gives."""
    model = tiny_teacher(arch)
    batch = prompts(10, seed=5)
    lengths = [3 + (2 * i) % 7 for i in range(10)]
    expected = [teacher_greedy(model, p, n) for p, n in zip(batch, lengths)]
    engine = Engine(model, max_batch=4, max_queue=16, prefill_chunk=7)
    assert engine.mode == "kv" and engine.stats()["mode"] == "kv"
    results = greedy_batch(engine, batch, lengths)
    assert [tokens for tokens, _ in results] == expected
    assert {reason for _, reason in results} == {"length"}
    assert 2 <= engine.peak_running <= 4  # batched, within the rows
    assert engine.stats()["running"] == 0 and engine._rows.cache.nbytes == 0  # the buffers go with the last request


def test_kv_mode_cancelling_a_request_frees_its_row_for_a_waiting_one():
    """Two rows: a request that would run for ever and a long one; a third waits. Cancelling the first
    hands its row on (the long one moves into row 0 as the first leaves, the waiting one takes row 1 and
    moves to row 0 in turn), and every request gets its offline tokens."""
    model = tiny_teacher("gemma3_text")
    endless, long, waiting, last = prompts(4, seed=6)
    engine = Engine(model, max_batch=2, max_queue=4, prefill_chunk=5)
    expected = {"long": teacher_greedy(model, long, 60), "waiting": teacher_greedy(model, waiting, 9),
                "last": teacher_greedy(model, last, 3), "endless": teacher_greedy(model, endless, 12)}

    async def main():
        forever = engine.submit(endless, SamplingParams(max_tokens=10_000, ignore_eos=True))
        second = asyncio.create_task(collect(engine, long, SamplingParams(max_tokens=60, ignore_eos=True)))
        await asyncio.sleep(0)
        queued = asyncio.create_task(collect(engine, waiting, SamplingParams(max_tokens=9, ignore_eos=True)))
        got, waited = [], None
        async for token in forever.tokens():
            got.append(token)
            if len(got) == 12:
                waited = engine.stats()["waiting"]  # both rows busy: the third request waits
                forever.cancel()
        after = await collect(engine, last, SamplingParams(max_tokens=3, ignore_eos=True))
        return (got, forever.finish_reason, waited), await second, await queued, after

    (got, reason, waited), second, queued, after = serve(engine, main())
    assert reason == "cancelled" and 12 <= len(got) < 10_000 and got[:12] == expected["endless"]
    assert waited == 1
    assert second == (expected["long"], "length")
    assert queued == (expected["waiting"], "length")
    assert after == (expected["last"], "length")
    assert engine.peak_running == 2


def test_kv_mode_admits_by_memory_and_refuses_a_request_too_big_for_the_budget():
    """A KV budget of two requests: the others wait in order and all finish with their offline tokens,
    and the buffers never pass what admission allowed; a request that could not fit even alone is
    refused at submission (the server's 400) while the others go on."""
    model = tiny_teacher("llama")
    per_token = kv_slots.kv_bytes_per_token(model.config, torch.float32)
    assert per_token == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    g = torch.Generator().manual_seed(7)
    batch = [torch.randint(3, 128, (12,), generator=g).tolist() for _ in range(8)]
    reach = 12 + 6
    budget = (2 * reach + 12) * per_token  # two rows of 18 positions and one prefill of 12 tokens; three never fit
    engine = Engine(model, max_batch=8, max_queue=16, prefill_chunk=6, kv_budget_bytes=budget)
    sizes = watch_kv_allocations(engine)
    expected = [teacher_greedy(model, p, 6) for p in batch]
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def main():
        running = [asyncio.create_task(collect_or_error(engine, p, params)) for p in batch[:4]]
        await asyncio.sleep(0)
        with pytest.raises(TooLarge, match="KV budget") as refused:
            engine.submit([5] * 10, SamplingParams(max_tokens=2 * reach, ignore_eos=True))
        assert "max_tokens" in str(refused.value)
        running += [asyncio.create_task(collect_or_error(engine, p, params)) for p in batch[4:]]
        return await asyncio.gather(*running)

    results = serve(engine, main())
    assert [(tokens, reason) for tokens, reason, _ in results] == [(e, "length") for e in expected]
    assert engine.peak_running == 2  # memory, not max_batch, bounded the batch
    assert sizes and max(sizes) <= 2 * reach * per_token


def test_a_request_queued_before_the_budget_is_known_and_too_big_for_it_ends_with_an_error():
    """The default budget is measured when the engine starts: what was queued before it and can never fit
    ends with an error at admission, and a request that fits is served."""
    model = tiny_teacher("llama")
    engine = Engine(model, max_batch=2, prefill_chunk=6)
    fits = [7, 8, 9]

    async def main():
        huge = engine.submit([5] * 10, SamplingParams(max_tokens=50, ignore_eos=True))
        small = asyncio.create_task(collect_or_error(engine, fits, SamplingParams(max_tokens=4, ignore_eos=True)))
        await asyncio.sleep(0)
        engine.kv_budget_bytes = (len(fits) + 4 + len(fits)) * engine.kv_bytes_per_token
        engine.start()
        try:
            async for _ in huge.tokens():
                pass
        except RuntimeError as e:
            return huge.finish_reason, str(e), await small
        return huge.finish_reason, None, await small

    try:
        reason, error, small = asyncio.run(main())
    finally:
        engine.stop()
    assert reason == "error" and "KV budget" in error
    assert small == (teacher_greedy(model, fits, 4), "length", None)


# The hybrid mode: linearized layers' states beside softmax layers' keys and values, in the rows of one
# BatchedKVCache, every running request stepped in one forward.

HYBRIDS = {
    "lizard": lambda: tiny_student("lizard", softmax_layers=[1]),
    "still": lambda: tiny_student("still", softmax_layers=[0]),
    "gemma3-layers-full": lambda: tiny_student("still", "gemma3_text", layers="full"),
}


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("hybrid", list(HYBRIDS))
def test_hybrids_batch_their_requests_and_give_each_its_offline_greedy_tokens(hybrid, rows):
    """A Lizard and a STILL hybrid (a layer kept softmax) and a Gemma 3 student whose sliding layers stay
    softmax (`layers=full`, window 6): eight prompts of 1 to 39 tokens, 3 to 9 tokens each, through 1, 2
    or 4 rows, arriving at different times and prefilled in chunks of 7 between the running requests'
    steps: each gets what HF's greedy generation of it alone gives, and with more than one row the
    requests step together."""
    model = HYBRIDS[hybrid]()
    batch = prompts(8, seed=9)
    lengths = [3 + (2 * i) % 7 for i in range(8)]
    expected = [teacher_greedy(model, p, n) for p, n in zip(batch, lengths)]
    engine = Engine(model, max_batch=rows, max_queue=16, prefill_chunk=7)
    assert engine.mode == "hybrid" and engine.stats()["mode"] == "hybrid"
    results = greedy_batch(engine, batch, lengths)
    assert [tokens for tokens, _ in results] == expected
    assert {reason for _, reason in results} == {"length"}
    assert min(rows, 2) <= engine.peak_running <= rows  # batched, within the rows
    assert engine.stats()["running"] == 0 and engine._rows.cache.nbytes == 0


def test_a_hybrid_admits_by_its_softmax_layers_memory_alone():
    """A Lizard hybrid with one softmax layer of two: a token's keys and values are that layer's alone, the
    linearized layer's state is not counted, and a budget of two requests' keys and values batches two
    at most, each with its offline tokens."""
    model = HYBRIDS["lizard"]()
    per_token = kv_slots.kv_bytes_per_token(model.config, torch.float32, layers=1)
    g = torch.Generator().manual_seed(8)
    batch = [torch.randint(3, 128, (12,), generator=g).tolist() for _ in range(5)]
    reach = 12 + 6
    engine = Engine(model, max_batch=8, max_queue=16, prefill_chunk=6, kv_budget_bytes=(2 * reach + 12) * per_token)
    assert engine.kv_bytes_per_token == per_token
    expected = [teacher_greedy(model, p, 6) for p in batch]

    async def main():
        return await asyncio.gather(*(collect_or_error(engine, p, SamplingParams(max_tokens=6, ignore_eos=True))
                                      for p in batch))

    results = serve(engine, main())
    assert [(tokens, reason) for tokens, reason, _ in results] == [(e, "length") for e in expected]
    assert engine.peak_running == 2


def test_a_decoder_of_one_mask_whose_layers_mix_full_and_sliding_attention_is_refused():
    """No batched mask fits both kinds of layer where the decoder takes one mask: the engine says so at
    once (the command's exit status 2) rather than serving it."""
    model = tiny_teacher("llama", sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="cannot serve this model: its layers mix full and sliding attention"):
        Engine(model)
