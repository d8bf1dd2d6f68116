"""BatchedKVCache: rows of different lengths, stepped together, decode as each sequence alone on HF's DynamicCache,
for softmax teachers and hybrids (linearized layers beside softmax ones) alike."""

import pytest
import torch
from tiny_models import ARCHITECTURES, tiny_student, tiny_teacher
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from linearize.serve.kv_slots import (
    FULL,
    LINEAR,
    ROWS_ATTENTION,
    SLIDING,
    BatchedKVCache,
    layer_kinds,
    masks_per_layer_type,
    rows_attention,
)
from linearize.serve.state_rows import StateRowsLayer


def prefill(model, ids: list[int], chunk: int = 4) -> tuple[DynamicCache, torch.Tensor]:
    """A batch-1 prefill in chunks, as the engine makes it (a sliding layer keeps its last window - 1
    tokens across the chunks): the cache and the last logits."""
    cache = DynamicCache(config=model.config)
    for start in range(0, len(ids), chunk):
        logits = model(torch.tensor([ids[start:start + chunk]]), past_key_values=cache, use_cache=True).logits
    return cache, logits[0, -1]


def random_ids(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(3, 128, (n,), generator=generator).tolist()


HYBRIDS = {
    "lizard-llama": lambda: tiny_student("lizard", softmax_layers=[1]),
    "still-llama": lambda: tiny_student("still", softmax_layers=[0]),
    "lizard-gemma3-full": lambda: tiny_student("lizard", "gemma3_text", layers="full"),
    "still-gemma3-full": lambda: tiny_student("still", "gemma3_text", layers="full"),
}
MODELS = {**{arch: (lambda arch=arch: tiny_teacher(arch)) for arch in ARCHITECTURES}, **HYBRIDS}


@pytest.mark.parametrize("name", list(MODELS))
def test_rows_of_different_lengths_step_as_each_sequence_alone(name):
    """Rows of 3, 11, 1 and 8 tokens (Gemma's window is 6), a fifth sequence loaded mid-way into a row
    cleared for it, another row moved to the front and its old row left idle but stepped: every step's
    logits are those of each sequence decoded alone, through a growth of the capacity, for softmax
    teachers and hybrids (linearized layers' states beside softmax keys and values)."""
    model = MODELS[name]()
    g = torch.Generator().manual_seed(0)
    kv = BatchedKVCache(model)
    alone: dict[int, DynamicCache] = {}  # row: the same sequence on its own DynamicCache
    with torch.no_grad():
        for row, length in enumerate([3, 11, 1, 8]):
            ids = random_ids(length, g)
            kv.load_row(row, prefill(model, ids)[0], length)
            alone[row] = prefill(model, ids)[0]
        assert kv.rows == 4 and kv.capacity == 16
        for step in range(14):
            if step == 4:  # row 2 finishes; a new sequence of 9 tokens takes its row
                kv.clear_row(2)
                ids = random_ids(9, g)
                kv.load_row(2, prefill(model, ids)[0], 9)
                alone[2] = prefill(model, ids)[0]
            if step == 8:  # row 0 finishes; the last row's sequence moves into it, row 3 idles
                kv.clear_row(0)
                kv.move_row(3, 0)
                alone[0] = alone.pop(3)
            tokens = torch.randint(3, 128, (4, 1), generator=g)
            logits = kv.step(model, tokens)
            assert logits.shape == (4, 1, model.config.vocab_size) and torch.isfinite(logits).all()
            for row, cache in alone.items():
                expected = model(tokens[row:row + 1], past_key_values=cache, use_cache=True).logits[0, -1]
                torch.testing.assert_close(logits[row, -1], expected, atol=1e-5, rtol=1e-5)
    assert kv.capacity == 32  # row 1 passed 16 positions
    assert kv.host_lengths == [8 + 14, 11 + 14, 9 + 10, 0] == kv.lengths.tolist()


def test_the_buffers_grow_within_their_limits_and_shrink_to_them():
    """Gemma 3's full layer grows with the rows' lengths within the limits; its two sliding layers (window
    6) hold rings of 6 positions a row, whatever the capacity."""
    model = tiny_teacher("gemma3_text")
    g = torch.Generator().manual_seed(1)
    kv = BatchedKVCache(model)
    kv.set_limits(rows=3, capacity=20)
    with torch.no_grad():
        kv.load_row(0, prefill(model, random_ids(15, g))[0], 15)
        assert (kv.rows, kv.capacity) == (3, 16)  # the rows of the limit at once; the capacity by powers of two
        for _ in range(3):
            kv.step(model, torch.randint(3, 128, (1, 1), generator=g))
        assert (kv.rows, kv.capacity) == (3, 20)  # 32 was due, 20 is the limit
        assert [layer.keys.shape[2] for layer in kv.layers] == [6, 6, 20]
        per_position = kv.layers[2].keys.nbytes // (3 * 20)  # keys or values of one layer
        assert kv.nbytes == 2 * per_position * 3 * (20 + 6 + 6)
        kv.set_limits(rows=1, capacity=19)
        kv.fit()
        assert (kv.rows, kv.capacity) == (1, 19) and kv.host_lengths == [18]
        assert [layer.keys.shape[2] for layer in kv.layers] == [6, 6, 19]
        kv.clear_row(0)
        kv.free()
        assert (kv.rows, kv.capacity, kv.nbytes) == (0, 0, 0)


def test_a_ring_below_its_window_holds_each_position_at_its_own_index_and_keeps_it_through_growth():
    """A row of 3 tokens in a sliding layer of window 6: the capacity (4, then 8 and 16 as the row grows)
    caps the ring at 4 positions, then 6, where it wraps; the row's keys stay where its next step reads them, and the steps
    give the logits of the sequence alone."""
    model = tiny_teacher("gemma3_text")
    g = torch.Generator().manual_seed(2)
    ids = random_ids(3, g)
    kv, (alone, _) = BatchedKVCache(model), prefill(model, ids)
    kv.set_limits(rows=1, capacity=4)
    with torch.no_grad():
        kv.load_row(0, prefill(model, ids)[0], 3)
        assert [layer.keys.shape[2] for layer in kv.layers] == [4, 4, 4]
        kv.set_limits(rows=1, capacity=None)
        for _ in range(6):
            token = torch.randint(3, 128, (1, 1), generator=g)
            expected = model(token, past_key_values=alone, use_cache=True).logits[0, -1]
            torch.testing.assert_close(kv.step(model, token)[0, -1], expected, atol=1e-5, rtol=1e-5)
    assert [layer.keys.shape[2] for layer in kv.layers] == [6, 6, 16]


def test_each_layer_of_a_hybrid_keeps_its_own_kind_of_rows():
    """A Gemma 3 student with `layers=full`: its sliding layers stay softmax (rings), its full layer is
    linearized (a state of one shape per row, whatever the lengths); a Lizard Llama with layer 1 kept."""
    gemma = tiny_student("lizard", "gemma3_text", layers="full")
    assert layer_kinds(gemma) == [SLIDING, SLIDING, LINEAR]
    assert layer_kinds(tiny_student("lizard", softmax_layers=[1])) == [LINEAR, FULL]
    assert layer_kinds(tiny_teacher("gemma3_text")) == [SLIDING, SLIDING, FULL]
    kv = BatchedKVCache(gemma)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for row, length in enumerate([2, 20]):
            kv.load_row(row, prefill(gemma, random_ids(length, g))[0], length)
        kv.step(gemma, torch.randint(3, 128, (2, 1), generator=g))
    state = kv.layers[2]
    assert isinstance(state, StateRowsLayer) and state.buffers
    assert all(t.shape[0] == kv.rows for t in state.buffers.values())
    assert [layer.keys.shape[2] for layer in kv.layers[:2]] == [6, 6] and kv.capacity == 32
    kv.free()
    assert kv.nbytes == 0 and state.buffers is None


def test_only_one_token_a_row_goes_through_the_batched_cache():
    model = tiny_teacher("llama")
    kv = BatchedKVCache(model)
    with torch.no_grad():
        kv.load_row(0, prefill(model, [5, 6, 7])[0], 3)
        kv._view = 4
        with pytest.raises(ValueError, match="one token per row"):
            model(torch.tensor([[5, 6]]), past_key_values=kv, use_cache=True)
        with pytest.raises(ValueError, match="1 to 1 rows"):
            kv.step(model, torch.tensor([[5], [6]]))


def test_mask_forms():
    per_type = {arch: masks_per_layer_type(tiny_teacher(arch).config) for arch in ARCHITECTURES}
    assert per_type == {"llama": False, "mistral": False, "qwen2": True, "qwen3": True, "gemma2": True,
                        "gemma3_text": True, "phi3": False, "olmo2": False}


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_rows_attention_is_attention_over_repeated_kv_heads(softcap):
    """The grouped step attention against the plain form: each query head reads its KV head
    (h // group), scores scaled, soft-capped where asked, masked, softmaxed."""
    torch.manual_seed(0)
    n, heads, kv_heads, length, dim = 3, 8, 2, 11, 16
    q = torch.randn(n, heads, 1, dim)
    k, v = torch.randn(n, kv_heads, length, dim), torch.randn(n, kv_heads, length, dim)
    mask = (torch.arange(length) < torch.tensor([[4], [11], [1]])).view(n, 1, 1, length)
    out, weights = rows_attention(None, q, k, v, mask, scaling=0.3, softcap=softcap)
    group = heads // kv_heads
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ keys.transpose(-1, -2) * 0.3
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    expected = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values
    assert weights is None and out.shape == (n, 1, heads, dim)
    torch.testing.assert_close(out, expected.transpose(1, 2))


def test_a_step_runs_the_rows_attention_and_gives_the_model_its_own_back():
    model = tiny_teacher("llama")
    cache = DynamicCache(config=model.config)
    model(torch.tensor([[3, 4, 5]]), past_key_values=cache, use_cache=True)
    kv = BatchedKVCache(model)
    kv.load_row(0, cache, 3)
    seen = []
    original = ALL_ATTENTION_FUNCTIONS[ROWS_ATTENTION]
    ALL_ATTENTION_FUNCTIONS[ROWS_ATTENTION] = lambda *a, **k: (seen.append(1), original(*a, **k))[1]
    try:
        kv.step(model, torch.tensor([[6]]))
    finally:
        ALL_ATTENTION_FUNCTIONS[ROWS_ATTENTION] = original
    assert len(seen) == model.config.num_hidden_layers
    assert model.config._attn_implementation == "sdpa"