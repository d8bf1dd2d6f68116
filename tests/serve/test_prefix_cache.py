"""Prefix caching in every mode: a prompt that starts with a cached prefix restores its prefill cache
(linearized states, sliding rings, full keys and values) and prefills only the rest, and gets the same
greedy tokens as without the cache."""

import asyncio

import pytest
import torch
from tiny_models import METHODS, tiny_student, tiny_teacher
from transformers import DynamicCache

from linearize.decode import fully_linearized, greedy_decode
from linearize.serve.engine import Engine, SamplingParams
from linearize.serve.prefix_cache import LayerSnapshot, PrefixCache, Snapshot, restored_cache, take_snapshot

BLOCK = 8


# Models with softmax layers (kv and hybrid modes): a Llama and a Gemma 3 teacher (two sliding layers of
# window 6, which the shared prefixes pass, so their rings wrap), a Lizard hybrid with one softmax layer,
# and a Gemma 3 student whose sliding layers stay softmax (`layers=full`).
SOFTMAX_MODELS = {
    "llama-teacher": lambda: tiny_teacher(),
    "gemma3-teacher": lambda: tiny_teacher("gemma3_text"),
    "lizard-hybrid": lambda: tiny_student("lizard", softmax_layers=[1]),
    "gemma3-layers-full": lambda: tiny_student("lizard", "gemma3_text", layers="full"),
}
MODES = {"llama-teacher": "kv", "gemma3-teacher": "kv", "lizard-hybrid": "hybrid", "gemma3-layers-full": "hybrid"}


def offline(model, prompt, n):
    """Greedy decoding of `prompt` alone: the library's for a fully linearized model, HF's for the others."""
    if fully_linearized(model):
        return greedy_decode(model, torch.tensor([prompt]), n, cuda_graph=False)[0].tolist()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _prefill(model, prompt, cache=None):
    """A batch-1 prefill cache of `prompt` (continued from `cache`, if given)."""
    cache = cache if cache is not None else DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    return cache


def tokens(count, seed):
    return torch.randint(3, 128, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_in_turn(engine, prompts, max_tokens=5):
    """Each prompt's greedy tokens, one request after the other (each sees what the ones before it cached)."""
    async def main():
        results = []
        for prompt in prompts:
            request = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            results.append([t async for t in request.tokens()])
        return results

    engine.start()
    try:
        return asyncio.run(main())
    finally:
        engine.stop()


def engine_for(model, static=False, prefill_chunk=16, **options):
    return Engine(model, max_batch=2, prefill_chunk=prefill_chunk, cuda_graph=False, static_prefill=static,
                  prefix_block=BLOCK, **options)


@pytest.mark.parametrize("static", [False, True], ids=["own-caches", "static-prefill"])
@pytest.mark.parametrize("method", METHODS)
def test_prompts_sharing_a_prefix_restore_it_and_get_their_offline_tokens(method, static):
    """Three prompts with the same 30 first tokens: the first is prefilled whole (kept at 16 and 32, the
    ends of its calls on block boundaries); the second restores 16 and stops a call at 24, where it parts
    from the first; the third restores 24. Each gets the tokens greedy decoding of it alone gives."""
    model = tiny_student(method)
    shared = tokens(30, seed=1)
    prompts = [shared + tokens(10, seed=2 + i) for i in range(3)]
    engine = engine_for(model, static)
    assert run_in_turn(engine, prompts) == [offline(model, p, 5) for p in prompts]
    stats = engine.stats()["prefix_cache"]
    assert stats["hit_tokens"] == 16 + 24
    assert stats["query_tokens"] == 3 * 40
    assert engine.prefilled_tokens == 3 * 40 - (16 + 24)


@pytest.mark.parametrize("name", list(SOFTMAX_MODELS))
def test_softmax_and_hybrid_models_restore_shared_prefixes_and_get_their_offline_tokens(name):
    """The three prompts of the test above, on models with softmax layers: the same restores (16, then 24),
    the same greedy tokens as HF's generation of each prompt alone."""
    model = SOFTMAX_MODELS[name]()
    shared = tokens(30, seed=1)
    prompts = [shared + tokens(10, seed=2 + i) for i in range(3)]
    engine = engine_for(model)
    assert engine.mode == MODES[name]
    assert run_in_turn(engine, prompts) == [offline(model, p, 5) for p in prompts]
    stats = engine.stats()["prefix_cache"]
    assert stats["enabled"] and stats["hit_tokens"] == 16 + 24
    assert engine.prefilled_tokens == 3 * 40 - (16 + 24)


@pytest.mark.parametrize("name", ["lizard-student", "gemma3-teacher", "lizard-hybrid"])
def test_a_multi_turn_conversation_restores_each_turns_prompt(name):
    """Each turn's prompt is the last one, its reply and a new message: it restores the last prompt's end
    rounded down to a block, and prefills the rest."""
    model = tiny_student() if name == "lizard-student" else SOFTMAX_MODELS[name]()
    engine = engine_for(model)
    engine.start()
    history, expected, hits = [], [], []

    async def conversation():
        nonlocal history
        for turn in range(3):
            history = history + tokens(11 + turn, seed=10 + turn)
            before = engine.prefix_cache.hit_tokens
            request = engine.submit(history, SamplingParams(max_tokens=6, ignore_eos=True))
            reply = [t async for t in request.tokens()]
            expected.append(offline(model, history, 6) == reply)
            hits.append(engine.prefix_cache.hit_tokens - before)
            history = history + reply

    try:
        asyncio.run(conversation())
    finally:
        engine.stop()
    assert all(expected)
    # Prompts of 11, 11 + 6 + 12 = 29 and 29 + 6 + 13 = 48 tokens: the second restores 8 (11 rounded down),
    # the third 24 (29 rounded down).
    assert hits == [0, 8, 24]


def test_a_prompt_as_long_as_a_cached_prefix_restores_a_shorter_one():
    """A prompt of exactly 16 tokens, cached at 8 and 16 by an earlier longer prompt (prefilled a block a
    call), restores 8: its last token is prefilled, for the logits of the first generated one. A prompt
    ending inside a block restores the block boundary before it."""
    model = tiny_student()
    long = tokens(20, seed=3)
    prompts = [long, long[:16], long[:13]]
    engine = engine_for(model, prefill_chunk=BLOCK)
    assert run_in_turn(engine, prompts) == [offline(model, p, 5) for p in prompts]
    assert engine.stats()["prefix_cache"]["hit_tokens"] == 8 + 8


@pytest.mark.parametrize("host", [False, True], ids=["device-only", "host-tier"])
@pytest.mark.parametrize("name", ["lizard", "still", "llama-teacher", "gemma3-teacher"])
def test_a_tiny_budget_evicts_the_least_recently_used_and_keeps_outputs_identical(name, host):
    """With room for one snapshot on the device (of 16 tokens: a full layer's keys and values count by the
    token), each new one pushes the last out: the prompts still get their offline tokens. Without a host
    tier a prompt whose prefix was dropped prefills it again; with room for one more on the host (on a CPU
    the same memory: the tiers differ in their accounting alone) the pushed-out one waits there and comes
    back for the prompt that needs it."""
    model = SOFTMAX_MODELS[name]() if name in SOFTMAX_MODELS else tiny_student(name)
    probe = engine_for(model)
    run_in_turn(probe, [tokens(17, seed=4)], max_tokens=1)  # kept at 16
    one = probe.prefix_cache.nbytes
    shared, other = tokens(20, seed=5), tokens(20, seed=6)
    prompts = [shared + [5], other + [6], shared + [7], shared + [8]]
    engine = engine_for(model, prefix_cache_bytes=one, prefix_cache_host_bytes=one if host else 0)
    assert run_in_turn(engine, prompts) == [offline(model, p, 5) for p in prompts]
    stats = engine.stats()["prefix_cache"]
    assert stats["bytes"] == one and stats["host_budget_bytes"] == (one if host else 0)
    if not host:
        assert stats["entries"] == 1 and stats["evictions"] > 0
        assert stats["host_bytes"] == stats["offloads"] == stats["reloads"] == 0
        # The third prompt finds the first's prefix gone (the second's took its place), the fourth the third's.
        assert stats["hit_tokens"] == 16
        return
    # The second prompt's snapshot pushes the first's to the host; the third brings it back (pushing the
    # second's out), and the fourth finds it on the device.
    assert (stats["entries"], stats["host_entries"], stats["host_bytes"]) == (2, 1, one)
    assert (stats["offloads"], stats["reloads"], stats["evictions"]) == (2, 1, 0)
    assert stats["hit_tokens"] == 16 + 16


@pytest.mark.parametrize("name", ["lizard-student", "llama-teacher"])
def test_without_the_cache_every_prompt_is_prefilled_whole(name):
    model = tiny_student() if name == "lizard-student" else SOFTMAX_MODELS[name]()
    shared = tokens(30, seed=1)
    prompts = [shared + [4], shared + [5]]
    engine = engine_for(model, prefix_cache=False)
    assert run_in_turn(engine, prompts) == [offline(model, p, 5) for p in prompts]
    assert engine.prefilled_tokens == 62
    assert engine.prefix_cache is None
    assert engine.stats()["prefix_cache"] == {"enabled": False, "why": "turned off"}


def test_every_mode_has_the_cache_by_default():
    for model, mode in [(tiny_student(), "slots"), (tiny_teacher(), "kv"), (SOFTMAX_MODELS["lizard-hybrid"](), "hybrid")]:
        engine = Engine(model, cuda_graph=False)
        assert engine.mode == mode and engine.stats()["prefix_cache"]["enabled"] is True


@pytest.mark.parametrize("name", ["lizard-student", *SOFTMAX_MODELS])
def test_a_restored_snapshot_continues_as_the_prefill_it_was_taken_from(name):
    """A snapshot of a prefill after 24 tokens (calls of 16 and 8), restored into a new cache: the next
    7 tokens' logits are those of the prefill that went on, and the snapshot, a copy, is unchanged by
    either. Per layer it holds a linearized layer's state, a sliding layer's last window - 1 keys and
    values (window 6: its ring has wrapped), a full layer's keys and values of all 24 positions."""
    model = tiny_student() if name == "lizard-student" else SOFTMAX_MODELS[name]()
    prompt = tokens(31, seed=7)
    cache = _prefill(model, prompt[16:24], _prefill(model, prompt[:16]))
    snapshot = take_snapshot(cache, 24)
    saved = [{k: t.clone() for k, t in part.tensors.items()} for part in snapshot.layers]
    kinds = [("linear" if part.linear else "sliding" if part.sliding else "full") for part in snapshot.layers]
    for part, kind in zip(snapshot.layers, kinds):
        if kind != "linear":
            assert part.tensors["keys"].shape[2] == (5 if kind == "sliding" else 24)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([prompt[24:]]), past_key_values=cache, use_cache=True).logits
        for _ in range(2):
            restored = restored_cache(model.config, snapshot)
            logits = model(input_ids=torch.tensor([prompt[24:]]), past_key_values=restored, use_cache=True).logits
            torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    for part, before in zip(snapshot.layers, saved):
        assert all(torch.equal(part.tensors[k], before[k]) for k in before)
    expected_kinds = {"lizard-student": {"linear"}, "llama-teacher": {"full"}, "gemma3-teacher": {"sliding", "full"},
                      "lizard-hybrid": {"linear", "full"}, "gemma3-layers-full": {"linear", "sliding"}}
    assert set(kinds) == expected_kinds[name]


def test_a_full_layers_snapshot_grows_with_its_prefix_and_a_sliding_layers_does_not():
    model = tiny_teacher("gemma3_text")  # two sliding layers, then a full one
    prompt = tokens(32, seed=8)
    short, long = (take_snapshot(_prefill(model, prompt[:n]), n) for n in (16, 32))
    assert [p.nbytes for p in long.layers[:2]] == [p.nbytes for p in short.layers[:2]]
    assert long.layers[2].nbytes == 2 * short.layers[2].nbytes
    cache = PrefixCache(block=16, budget_bytes=short.nbytes)
    assert cache.insert(prompt[:16], short) and not cache.insert(prompt, long)  # counted whole, by the token


def test_a_snapshot_restores_only_into_the_model_it_was_taken_from():
    snapshot = take_snapshot(_prefill(tiny_teacher("gemma3_text"), tokens(8, seed=9)), 8)
    with pytest.raises(ValueError, match="another model"):
        restored_cache(tiny_teacher().config, snapshot)


def test_a_request_for_its_prompts_logprobs_neither_reads_nor_feeds_the_cache():
    model = tiny_student()
    prompt = tokens(30, seed=1)
    engine = engine_for(model)

    async def main():
        scored = engine.submit(prompt, SamplingParams(max_tokens=2, prompt_logprobs=0))
        [t async for t in scored.tokens()]
        return scored

    engine.start()
    try:
        scored = asyncio.run(main())
    finally:
        engine.stop()
    assert len(scored.prompt_logprobs) == 30
    assert engine.prefix_cache.entries == 0 and engine.prefix_cache.query_tokens == 0


def snapshot(tokens_in: int, size: int = 4) -> Snapshot:
    return Snapshot(tokens_in, [LayerSnapshot({"s": torch.zeros(size)}, linear=True)])  # `size` float32s: 4 * size bytes


def test_the_tree_finds_the_longest_cached_prefix_and_how_far_a_prompt_follows_cached_ones():
    cache = PrefixCache(block=2, budget_bytes=1000)
    assert cache.insert([1, 2, 3, 4, 5, 6], snapshot(6))
    assert cache.insert([1, 2], snapshot(2))
    found = cache.lookup([1, 2, 3, 4, 9, 9, 9])
    assert found.snapshot.tokens == 2 and found.followed == 4  # blocks [1, 2], [3, 4]; a snapshot only at 2
    found = cache.lookup([1, 2, 3, 4, 5, 6])  # the whole prompt is cached, but its last token must be prefilled
    assert found.snapshot.tokens == 2 and found.followed == 4
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7]).snapshot.tokens == 6
    assert cache.lookup([7, 8, 9]).snapshot is None
    assert (cache.query_tokens, cache.hit_tokens) == (7 + 6 + 7 + 3, 2 + 2 + 6)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], snapshot(3))


def test_eviction_drops_the_least_recently_used_and_prunes_the_paths_to_nothing():
    cache = PrefixCache(block=2, budget_bytes=2 * 16)  # room for two snapshots of 16 bytes
    cache.insert([1, 2], snapshot(2))
    cache.insert([3, 4, 5, 6], snapshot(4))
    assert cache.holds([1, 2])  # now the most recently used
    cache.insert([7, 8], snapshot(2))
    assert not cache.holds([3, 4, 5, 6]) and cache.holds([1, 2]) and cache.holds([7, 8])
    assert cache.lookup([3, 4, 5, 6, 0]).followed == 0  # the dropped snapshot's path went with it
    assert (cache.entries, cache.nbytes, cache.evictions) == (2, 32, 1)
    assert not cache.insert([9, 9], snapshot(2, size=9))  # bigger than the whole budget: not kept
    assert cache.entries == 2
    cache.clear()
    assert (cache.entries, cache.nbytes) == (0, 0) and not cache._root.children


def test_a_full_device_tier_moves_its_least_recently_used_to_the_host_and_a_lookup_brings_it_back():
    """Two tiers of room for two 16-byte snapshots each (on a CPU the host is the same memory: the test checks
    the accounting and the order; `test_gpu_snapshots_move_to_host_memory_and_back` the moves)."""
    cache = PrefixCache(block=2, budget_bytes=2 * 16, host_budget_bytes=2 * 16)
    a, b, c = snapshot(2), snapshot(2), snapshot(2)
    cache.insert([1, 2], a)
    cache.insert([3, 4], b)
    cache.insert([5, 6], c)  # pushes a, the least recently used, to the host
    assert a.on_host and not b.on_host and not c.on_host
    assert (cache.entries, cache.host_entries, cache.nbytes, cache.host_nbytes) == (3, 1, 32, 16)
    assert cache.offloads == 1 and cache.evictions == 0
    found = cache.lookup([1, 2, 0])  # a comes back as the most recently used, pushing b (now the least) out
    assert found.snapshot is a and not a.on_host and b.on_host
    assert (cache.offloads, cache.reloads, cache.nbytes, cache.host_nbytes) == (2, 1, 32, 16)
    assert cache.hit_tokens == 2
    cache.insert([7, 8], snapshot(2))  # pushes c out: the host holds b and c
    assert c.on_host and (cache.host_entries, cache.host_nbytes) == (2, 32)
    assert cache.holds([3, 4])  # b, kept on the host: now its most recently used there
    cache.insert([9, 9], snapshot(2))  # pushes a out; the host drops c, its least recently used, for good
    assert a.on_host and b.on_host and cache._find([5, 6]) is None  # c's path pruned
    assert (cache.entries, cache.evictions, cache.offloads) == (4, 1, 4)
    assert cache.stats() == {"enabled": True, "block": 2, "entries": 4, "bytes": 32, "budget_bytes": 32,
                                  "host_entries": 2, "host_bytes": 32, "host_budget_bytes": 32, "query_tokens": 3,
                                  "hit_tokens": 2, "evictions": 1, "offloads": 4, "reloads": 1}


def test_a_reload_never_pushes_out_the_snapshot_it_brings_back_and_follows_the_pruned_tree():
    """Bringing a back from the host pushes the device's only snapshot e out to the host, which drops d, the
    host's least recently used, for good, never a: a is out of both tiers while room is made. The path to d,
    which the prompt followed past a, goes with it, and the lookup's `followed` says so."""
    cache = PrefixCache(block=2, budget_bytes=32, host_budget_bytes=32)
    a, d, e = snapshot(2), snapshot(6), snapshot(2, size=8)
    cache.insert([1, 2, 3, 4, 5, 6], d)
    cache.insert([1, 2], a)
    cache.insert([7, 7], e)  # 32 bytes: d, then a, to the host
    assert d.on_host and a.on_host and not e.on_host
    found = cache.lookup([1, 2, 3, 4, 9, 9, 9])  # follows [1, 2] (a) and [3, 4] (on the way to d)
    assert found.snapshot is a and not a.on_host and e.on_host
    assert found.followed == 2 and cache._find([1, 2, 3, 4]) is None  # d dropped, its path pruned
    assert (cache.nbytes, cache.host_nbytes, cache.evictions, cache.reloads, cache.offloads) == (16, 32, 1, 1, 3)


def test_a_snapshot_bigger_than_the_host_budget_is_dropped_and_a_failed_reload_leaves_it_on_the_host(monkeypatch):
    cache = PrefixCache(block=2, budget_bytes=40, host_budget_bytes=16)
    cache.insert([1, 2], snapshot(2, size=10))  # 40 bytes: no room on the host
    cache.insert([3, 4], snapshot(2))
    assert (cache.entries, cache.host_entries, cache.evictions, cache.offloads) == (1, 0, 1, 0)
    small = snapshot(2)
    cache.insert([5, 6], small)
    cache.insert([7, 8], snapshot(2, size=8))  # 32 bytes: pushes [3, 4] to the host, then small, dropping [3, 4]
    assert small.on_host and cache._find([3, 4]) is None
    assert (cache.host_entries, cache.evictions, cache.offloads) == (1, 2, 2)

    def no_memory(self):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(Snapshot, "to_device", no_memory)
    found = cache.lookup([5, 6, 0])  # the device tier made room for it: [7, 8] is dropped (no room on the host)
    assert found.snapshot is None and small.on_host and cache.holds([5, 6]) and cache.reloads == 0
    assert (cache.entries, cache.host_entries, cache.host_nbytes, cache.nbytes) == (1, 1, 16, 0)


def test_no_host_budget_drops_what_the_device_pushes_out_as_before():
    cache = PrefixCache(block=2, budget_bytes=16)
    first = snapshot(2)
    cache.insert([1, 2], first)
    cache.insert([3, 4], snapshot(2))
    assert not first.on_host and cache._find([1, 2]) is None
    assert (cache.entries, cache.evictions, cache.offloads, cache.host_nbytes) == (1, 1, 0, 0)
    assert cache.stats()["host_budget_bytes"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_snapshots_move_to_host_memory_and_back():
    """On CUDA a pushed-out snapshot's tensors really move to pinned CPU memory, and come back to the device
    they were taken on with the same values; one restored while on the host lands on its device too."""
    model = tiny_student().cuda()
    prompt = tokens(17, seed=11)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prompt[:16]], device="cuda"), past_key_values=cache, use_cache=True)
    taken = take_snapshot(cache, 16)
    values = [{k: t.clone() for k, t in part.tensors.items()} for part in taken.layers]
    prefix = PrefixCache(block=BLOCK, budget_bytes=taken.nbytes, host_budget_bytes=taken.nbytes)
    prefix.insert(prompt[:16], taken)
    prefix.insert(tokens(16, seed=12), take_snapshot(cache, 16))  # pushes `taken` to the host
    assert taken.on_host and taken.device == torch.device("cuda", torch.cuda.current_device())
    tensors = [t for part in taken.layers for t in part.tensors.values()]
    assert all(t.device.type == "cpu" and t.is_pinned() for t in tensors)
    restored = restored_cache(model.config, taken)  # from the host tier: copies on the device
    assert all(t.is_cuda for layer in restored.layers for t in layer.state.values())
    found = prefix.lookup(prompt)
    assert found.snapshot is taken and not taken.on_host and prefix.reloads == 1
    for part, before in zip(taken.layers, values):
        assert all(t.is_cuda and torch.equal(t, before[k]) for k, t in part.tensors.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_with_a_host_tier_gets_the_tokens_it_gets_without_a_cache():
    model = tiny_student().cuda()
    probe = engine_for(model)
    run_in_turn(probe, [tokens(17, seed=4)], max_tokens=1)
    one = probe.prefix_cache.nbytes
    shared, other = tokens(20, seed=5), tokens(20, seed=6)
    prompts = [shared + [5], other + [6], shared + [7], shared + [8]]
    engine = engine_for(model, prefix_cache_bytes=one, prefix_cache_host_bytes=one)
    assert run_in_turn(engine, prompts) == run_in_turn(engine_for(model, prefix_cache=False), prompts)
    stats = engine.stats()["prefix_cache"]
    assert stats["reloads"] == 1 and stats["offloads"] == 2 and stats["hit_tokens"] == 32
