"""The fixed-shape decoder: the same tokens as the uncached model, state written in place."""

import pytest
import torch
from tiny_models import ARCHITECTURES, METHODS, tiny_student

from linearize.decode import StaticDecoder, fully_linearized, greedy_decode, until_end


def uncached_greedy(model, ids, n):
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    return seq[:, ids.shape[1]:]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_decode_equals_the_uncached_model(method):
    model = tiny_student(method)
    ids = torch.randint(3, 128, (2, 19), generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy_decode(model, ids, 14, cuda_graph=False), uncached_greedy(model, ids, 14))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_prompt_prefilled_in_pieces_decodes_as_in_one_call(method, arch):
    """Prefill calls of a few tokens (left padding in the first ones, Gemma's sliding masks across
    them) continue one state: the tokens are the one-call prefill's."""
    model = tiny_student(method, arch)
    ids = torch.randint(3, 128, (2, 23), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    one_call = greedy_decode(model, ids, 8, attention_mask=mask, cuda_graph=False)
    assert torch.equal(greedy_decode(model, ids, 8, attention_mask=mask, cuda_graph=False, prefill_tokens=10), one_call)


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "llama"])
def test_every_family_decodes_with_fused_projections_as_uncached(arch):
    """The static decoder fuses q/k/v (and the MLP's gate and up) into one GEMM each: with q/k norms,
    Phi-3's split qkv and Gemma's GELU MLP it still writes the uncached model's tokens."""
    model = tiny_student("lizard", arch)
    ids = torch.randint(3, 128, (2, 15), generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy_decode(model, ids, 10, cuda_graph=False), uncached_greedy(model, ids, 10))


def test_decoding_stops_once_every_row_has_ended_and_until_end_cuts_each_row():
    model = tiny_student("still")
    ids = torch.randint(3, 128, (3, 11), generator=torch.Generator().manual_seed(1))
    full = greedy_decode(model, ids, 8, cuda_graph=False)
    ends = full[:, 2].tolist()  # every row ends by its third token
    stopped = greedy_decode(model, ids, 8, eos_token_id=ends, cuda_graph=False)
    last = max(next(i for i, t in enumerate(row) if t in ends) for row in full.tolist())
    assert torch.equal(stopped, full[:, : last + 1])
    cut = until_end(full, ends)
    assert [len(row) for row in cut] == [next(i for i, t in enumerate(row) if t in ends) for row in full.tolist()]
    assert all(row == full[i, : len(row)].tolist() for i, row in enumerate(cut))
    assert fully_linearized(model) and not fully_linearized(tiny_student("lizard", softmax_layers=[1]))


def test_steps_write_the_state_in_place():
    from transformers import DynamicCache

    model = tiny_student("lizard")
    cache = DynamicCache(config=model.config)
    ids = torch.randint(3, 128, (1, 9))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    decoder = StaticDecoder(model, cache, batch=1, cuda_graph=False)
    addresses = {name: t.data_ptr() for name, t in cache.layers[0].state.items()}
    before = cache.layers[0].state["S"].clone()
    decoder.step(torch.tensor([[5]]))
    assert {name: t.data_ptr() for name, t in cache.layers[0].state.items()} == addresses
    assert not torch.equal(cache.layers[0].state["S"], before) and decoder.seen == 10


def test_refuses_what_it_cannot_decode():
    from transformers import DynamicCache

    hybrid = tiny_student("lizard", softmax_layers=[1])
    cache = DynamicCache(config=hybrid.config)
    with torch.no_grad():
        hybrid(torch.randint(3, 128, (1, 5)), past_key_values=cache)
    with pytest.raises(ValueError, match="fully linearized"):
        StaticDecoder(hybrid, cache, batch=1)
    with pytest.raises(ValueError, match="CUDA"):
        greedy_decode(tiny_student("lizard"), torch.randint(3, 128, (1, 5)), 2, cuda_graph=True)
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_decode(tiny_student("lizard"), torch.randint(3, 128, (1, 5)), 0)


def test_a_step_that_cannot_be_captured_runs_eagerly(monkeypatch):
    from transformers import DynamicCache

    model = tiny_student("lizard")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
    decoder = StaticDecoder(model, cache, batch=1, cuda_graph=False)
    decoder.graphed = True  # as on a GPU, where capturing then fails

    def fail():
        raise RuntimeError("operation not permitted when stream is capturing\ndetails")

    monkeypatch.setattr(decoder, "_capture", fail)
    logits = decoder.step(token)
    assert decoder.path == ("eager (graph capture failed: RuntimeError: operation not permitted when stream is "
                            "capturing), fused projections")
    expected = model(torch.cat([ids, token], 1), use_cache=False).logits[:, -1:]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_compiled_step_gives_the_same_tokens_and_a_failed_compile_steps_uncompiled(monkeypatch):
    """`compile_backend`: the step through torch.compile (aot_eager on CPU: dynamo's trace, no codegen)
    decodes the uncached model's tokens; a step that fails to compile runs uncompiled and says why."""
    from transformers import DynamicCache

    model = tiny_student("lizard")
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(2))
    expected = uncached_greedy(model, ids, 4)

    def decode(compile_fails: bool):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        if compile_fails:
            monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: lambda: 1 / 0)
        decoder = StaticDecoder(model, cache, batch=2, cuda_graph=False, compile_backend="aot_eager")
        tokens = [token]
        for _ in range(3):
            tokens.append(decoder.step(tokens[-1])[:, -1:].argmax(-1))
        assert torch.equal(torch.cat(tokens, 1), expected)
        path = decoder.path
        decoder.close()
        with pytest.raises(RuntimeError, match="closed"):
            decoder.step(tokens[-1])
        return path

    assert decode(compile_fails=False) == "eager, fused projections, compiled (aot_eager)"
    assert decode(compile_fails=True) == "eager, fused projections, not compiled (ZeroDivisionError: division by zero)"


@pytest.mark.slow
def test_eager_compiled_steps_compile_twice_then_reuse_the_graph():
    """Dynamo specialises the first step on the cache's token count, then makes that count dynamic:
    later steps reuse the second graph (specialised on every count, each token compiled anew)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_student("lizard")
    ids = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(3))
    tokens = greedy_decode(model, ids, 7, cuda_graph=False, compile_backend="aot_eager")
    assert torch.equal(tokens, uncached_greedy(model, ids, 7))
    assert counters["stats"]["unique_graphs"] == 2


def test_still_compiles_its_attention_step_once_for_every_layer_and_step(monkeypatch):
    """STILL's step is compiled alone (its position lives in the state: nothing to specialise on) and
    every layer calls the same compiled function: one graph for both layers and all steps. `close`
    gives the layers the plain step back; a step that fails to compile runs uncompiled."""
    from torch._dynamo.utils import counters
    from transformers import DynamicCache

    from linearize.attention.still import StillAttention
    from linearize.ops.still.naive import still_step

    torch._dynamo.reset()
    counters.clear()
    model = tiny_student("still")
    layers = [m for m in model.modules() if isinstance(m, StillAttention)]
    assert len(layers) == 2
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(4))
    expected = uncached_greedy(model, ids, 6)

    def decode():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        decoder = StaticDecoder(model, cache, batch=2, cuda_graph=False, compile_backend="aot_eager")
        tokens = [token]
        for _ in range(5):
            tokens.append(decoder.step(tokens[-1])[:, -1:].argmax(-1))
        path = decoder.path
        assert all(layer.decode_step is not still_step for layer in layers) == path.endswith("every layer)")
        decoder.close()
        assert all(layer.decode_step is still_step for layer in layers)
        assert torch.equal(torch.cat(tokens, 1), expected)
        return path

    assert decode() == "eager, fused projections, compiled (aot_eager, the attention step once for every layer)"
    assert counters["stats"]["unique_graphs"] == 1
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: lambda *args, **kw: 1 / 0)
    assert decode() == "eager, fused projections, not compiled (ZeroDivisionError: division by zero)"
