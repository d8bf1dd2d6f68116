"""The fixed-shape prefill: chunks of captured sizes into one reused cache give the one-call prefill's
logits and state, sequence after sequence."""

import pytest
import torch
from tiny_models import METHODS, TINY_OPTIONS, perturb_new_parameters, tiny_student, tiny_teacher
from transformers import DynamicCache

import linearize
from linearize.decode import StaticDecoder
from linearize.prefill import StaticPrefill, largest_size, power_of_two_sizes


def one_call(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:]
    return logits, cache


def chunked(prefill, prompt, largest):
    """The prompt in chunks of the largest captured size that fits, as the serving engine cuts it."""
    done, logits = 0, None
    while done < len(prompt):
        size = largest_size(prefill.sizes, min(largest, len(prompt) - done))
        logits = prefill.run(prompt[done:done + size])
        done += size
    return logits


def test_sizes_are_powers_of_two_and_a_chunk_takes_the_largest_that_fits():
    assert power_of_two_sizes(16) == (1, 2, 4, 8, 16)
    assert power_of_two_sizes(20) == (1, 2, 4, 8, 16)
    assert power_of_two_sizes(0) == (1,)
    assert largest_size((1, 2, 4, 8), 7) == 4 and largest_size((1, 2, 4, 8), 100) == 8
    assert largest_size((4, 8), 3) == 3  # none fits: the chunk as it is (run eagerly)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_chunks_into_the_fixed_cache_give_the_one_call_prefill_sequence_after_sequence(method, arch):
    """Three prompts, one after another through the same cache (each starting fresh, nothing left of
    the one before), in chunks of 8, 4, 2 and 1 tokens: each prompt's last logits and every layer's
    state are the one-call prefill's."""
    model = tiny_student(method, arch).eval()
    prefill = StaticPrefill(model, sizes=power_of_two_sizes(8), cuda_graph=False)
    generator = torch.Generator().manual_seed(5)
    for length in (23, 5, 17):
        ids = torch.randint(3, 128, (1, length), generator=generator)
        expected, cache = one_call(model, ids)
        prefill.reset()
        logits = chunked(prefill, ids[0].tolist(), 8)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        assert prefill.seen == length
        for mine, theirs in zip(prefill.cache.layers, cache.layers, strict=True):
            for name, tensor in theirs.state.items():
                torch.testing.assert_close(mine.state[name], tensor, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("method", METHODS)
def test_a_row_loaded_from_the_prefill_decodes_as_the_one_call_prefill(method):
    model = tiny_student(method).eval()
    ids = torch.randint(3, 128, (1, 13), generator=torch.Generator().manual_seed(2))
    expected_logits, cache = one_call(model, ids)
    reference = StaticDecoder(model, cache, batch=1, cuda_graph=False)
    prefill = StaticPrefill(model, sizes=(4,), cuda_graph=False)
    logits = chunked(prefill, ids[0].tolist(), 4)  # 4, 4, 4 and one eager token (no size fits)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    start = torch.zeros(2, 1, dtype=torch.long)
    slots = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=start, past_key_values=slots, use_cache=True, logits_to_keep=1)
    decoder = StaticDecoder(model, slots, batch=2, cuda_graph=False)
    decoder.load_row(1, prefill.cache, 13)
    token = expected_logits.argmax(-1)
    for _ in range(6):
        mine = decoder.step(torch.cat([torch.zeros_like(token), token]))[1:]
        theirs = reference.step(token)
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
        token = theirs.argmax(-1)


def test_refuses_a_model_with_softmax_layers_and_graphs_without_a_gpu():
    model = tiny_teacher("llama")
    with pytest.raises(ValueError, match="fully linearized"):
        StaticPrefill(model, sizes=(4,))
    with pytest.raises(ValueError, match="CUDA device"):
        StaticPrefill(tiny_student("lizard").eval(), sizes=(4,), cuda_graph=True)


def test_a_chunk_that_cannot_be_captured_runs_eagerly(monkeypatch):
    """On a GPU where capture fails: `graph_error` says why, and every chunk runs eagerly, with the
    same result."""
    model = tiny_student("lizard").eval()
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    expected, _ = one_call(model, ids)
    prefill = StaticPrefill(model, sizes=(4, 8), cuda_graph=False)
    prefill.graphed = True  # as on a GPU, where capturing then fails

    def no_capture(device):
        raise RuntimeError("operation not permitted when stream is capturing\ndetails")

    monkeypatch.setattr("linearize.decode.capture_stream", no_capture)
    logits = chunked(prefill, ids[0].tolist(), 8)
    assert not prefill.graphed
    assert prefill.graph_error == "RuntimeError: operation not permitted when stream is capturing"
    assert prefill.path == "eager (graph capture failed: RuntimeError: operation not permitted when stream is capturing)"
    assert StaticPrefill(model, sizes=(4,), cuda_graph=False).path == "eager"
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_every_chunk_is_marked_unpadded_whatever_mask_hf_builds(arch, monkeypatch):
    """What a graph's capture refuses: the kernels' dispatch reading the tokens' validity back from the
    device (`gla_window.row_layout`), which it does for a call with a mask unless told every token is
    valid. HF builds a mask for eager attention and for Gemma's sliding layers; the prefill's cache
    holds one sequence, never padded, so every layer's call is marked unpadded, with the same result."""
    from linearize.attention.lizard import LizardAttention

    model = tiny_teacher(arch)
    model.config._attn_implementation = "eager"  # a mask on every call
    linearize.convert(model, "lizard", **TINY_OPTIONS["lizard"])
    perturb_new_parameters(model)
    model.eval()
    ids = torch.randint(3, 128, (1, 21), generator=torch.Generator().manual_seed(7))
    calls = []  # each layer call's `Pass`
    attend = LizardAttention.attend

    def recorded(self, *args):
        calls.append(args[-1])
        return attend(self, *args)

    monkeypatch.setattr(LizardAttention, "attend", recorded)
    expected, _ = one_call(model, ids)
    layers = model.config.num_hidden_layers
    assert len(calls) == layers and not any(call.unpadded for call in calls)  # the one-call prefill had its mask
    prefill = StaticPrefill(model, sizes=(8,), cuda_graph=False)
    done = 0
    for size in (8, 8, 5):
        calls.clear()
        logits = prefill.run(ids[0, done:done + size].tolist())
        done += size
        assert len(calls) == layers and all(call.unpadded for call in calls)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
