"""The decode cache has constant size for Lizard/Liger/LoLCATs and is capped by the budget for STILL."""

import pytest
import torch
from tiny_models import TINY_OPTIONS, tiny_teacher
from transformers import DynamicCache

import linearize
from linearize.cache import LinearizeCacheLayer, cache_nbytes, compact_softmax_layers


def generated_cache(method, new_tokens, **options):
    model = tiny_teacher()
    linearize.convert(model, method, **{**TINY_OPTIONS[method], **options})
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             return_dict_in_generate=True)
    assert out.sequences.shape[1] == 5 + new_tokens
    return out.past_key_values


@pytest.mark.slow
def test_lizard_cache_bytes_same_after_64_and_2000_tokens():
    short = generated_cache("lizard", 64, window=16)
    long = generated_cache("lizard", 2000, window=16)
    assert all(isinstance(layer, LinearizeCacheLayer) for layer in long.layers)
    assert long.get_seq_length() == 5 + 2000 - 1  # the last token is never fed back
    assert cache_nbytes(short) == cache_nbytes(long) > 0


@pytest.mark.parametrize("method", ["liger", "lolcats", "still"])
def test_cache_bytes_constant(method):
    assert cache_nbytes(generated_cache(method, 20)) == cache_nbytes(generated_cache(method, 300))


def test_still_softmax_entries_never_exceed_budget():
    budget, window = TINY_OPTIONS["still"]["budget"], TINY_OPTIONS["still"]["window"]
    model = tiny_teacher()
    linearize.convert(model, "still", **TINY_OPTIONS["still"])
    cache = None
    ids = torch.randint(3, 128, (2, 1), generator=torch.Generator().manual_seed(0))
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    held = []
    with torch.no_grad():
        for _ in range(120):
            logits = model(ids, past_key_values=cache).logits
            ids = logits[:, -1:].argmax(-1)
            for layer in cache.layers:
                state = layer.state
                # the window keeps w - 1 past tokens, plus the current one at attention time
                held.append(int(state["sal_used"].sum(-1).max()) + int(state["win_valid"].sum(-1).max()) + 1)
    assert max(held) == budget and window < budget


@pytest.mark.parametrize("method", ["lizard", "liger", "lolcats", "still"])
def test_a_long_prefill_leaves_no_chunk_sized_storage_in_the_cache(method):
    from transformers import DynamicCache

    model = tiny_teacher()
    linearize.convert(model, method, **TINY_OPTIONS[method])
    ids = torch.randint(3, 128, (2, 300), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        for name, tensor in layer.state.items():
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
    with torch.no_grad():  # the same bytes after a 20-token prefill: nothing in it grows with the prompt
        short = DynamicCache(config=model.config)
        model(ids[:, :20], past_key_values=short, use_cache=True)
    assert cache_nbytes(short) == cache_nbytes(cache)


def test_compact_softmax_layers_frees_what_sliding_layers_kept_of_a_prefill_call():
    """HF's sliding layer keeps a slice of the whole call's keys: compacting keeps the values, drops the rest,
    and `cache_nbytes` counts the memory held before and after."""
    model = tiny_teacher("gemma3_text")
    cache = DynamicCache(config=model.config)
    model(torch.randint(3, 100, (1, 40)), past_key_values=cache, use_cache=True)
    sliding = [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]
    assert sliding and all(layer.keys.shape[-2] < 40 for layer in sliding)
    before = cache_nbytes(cache)
    kept = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    compact_softmax_layers(cache)
    after = cache_nbytes(cache)
    assert after < before
    assert after == sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    for layer, (keys, values) in zip(cache.layers, kept, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
