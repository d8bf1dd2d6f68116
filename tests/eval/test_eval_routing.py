import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from linearize.config import StillConfig
from linearize.convert import convert
from linearize.eval.routing import (
    EVICTED,
    LEFT_WINDOW,
    VISIBLE,
    classify,
    fold_times,
    needle_positions,
    needle_routing,
    rotated_qk,
)

SMALL = {"window": 16, "chunk_size": 8}


def test_rotated_qk_are_the_attention_inputs_of_each_layer(model, tokenizer):
    ids = tokenizer("The whale sailed far into the night. " * 8, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states  # hidden[i]: layer i's input
        cos, sin = model.model.rotary_emb(hidden[0], torch.arange(ids.shape[1])[None])
        captured = rotated_qk(model, ids)
        assert len(captured) == len(model.model.layers)
        for i, ((q, k), layer) in enumerate(zip(captured, model.model.layers)):
            x = layer.input_layernorm(hidden[i])
            attn = layer.self_attn
            expected = apply_rotary_pos_emb(attn.q_proj(x).view(1, -1, 4, 16).transpose(1, 2),
                                            attn.k_proj(x).view(1, -1, 2, 16).transpose(1, 2), cos, sin)
            torch.testing.assert_close(q, expected[0])
            torch.testing.assert_close(k, expected[1])
        # A linearized model's layer 0 sees the teacher's input; its hooks are gone afterwards.
        student = convert(copy.deepcopy(model), "still", window=16, chunk_size=8, budget=32, max_chunks=4)
        torch.testing.assert_close(rotated_qk(student, ids)[0][1], captured[0][1])
    assert not any(layer.self_attn._forward_pre_hooks for layer in student.model.layers)


@pytest.fixture
def qk():
    torch.manual_seed(0)
    return torch.randn(1, 4, 200, 16), torch.randn(1, 2, 200, 16)


def fates(fold, window):
    return [classify(row, torch.arange(fold.shape[-1]), window) for row in fold[0]]


def test_no_folding_while_the_slots_hold_every_token(qk):
    cfg = StillConfig(**SMALL, budget=16 + 200, max_chunks=25)  # every chunk keeps all 8 of its tokens
    assert cfg.per_chunk == 8 and not cfg.folds_within(200)
    assert all(f == VISIBLE for row in fates(fold_times(*qk, cfg), 16) for f in row)


def test_without_slots_tokens_fold_as_they_leave_the_window(qk):
    for row in fates(fold_times(*qk, StillConfig(**SMALL, budget=16)), 16):
        assert row == [LEFT_WINDOW] * (200 - 16) + [VISIBLE] * 16


def test_full_slots_evict_and_keep_exactly_their_size(qk):
    cfg = StillConfig(**SMALL, budget=16 + 24, max_chunks=3)  # 24 slots, 8 picks a chunk: overflow
    fold = fold_times(*qk, cfg)
    for row in fates(fold, 16):
        assert row.count(EVICTED) > 0
        assert row.count(VISIBLE) == 16 + 24  # the window, and full slots
    # The saliency-picked tokens that survive are the best by score: another budget keeps more of them.
    bigger = fates(fold_times(*qk, StillConfig(**SMALL, budget=16 + 48, max_chunks=6)), 16)
    assert all(row.count(VISIBLE) == 16 + 48 for row in bigger)


def test_needle_positions_find_every_copy(tokenizer):
    prompt = "Key: 48213. Noise noise. 48213 is it."
    copies = needle_positions(tokenizer, prompt, "48213")
    ids = tokenizer(prompt).input_ids
    assert len(copies) == 2
    assert [tokenizer.decode([ids[i] for i in c]) for c in copies] == ["48213", "48213"]
    assert needle_positions(tokenizer, prompt, "99999") == []


@pytest.mark.parametrize("task", ["passkey", "niah_single"])
def test_needle_routing_reports_reach_and_fates(model, tokenizer, task):
    configs = {"keep all": StillConfig(**SMALL, budget=16 + 1024, max_chunks=128),
               "window only": StillConfig(**SMALL, budget=16)}
    result = needle_routing(model, tokenizer, configs, task=task, lengths=[600], depths=[0, 50])
    keep, window = result["results"]["keep all"]["600"], result["results"]["window only"]["600"]
    layers = len(model.model.layers)
    assert keep["reachable"] == 1.0 and keep["reachable_by_layer"] == [1.0] * layers
    assert keep["tokens"] == {VISIBLE: 1.0, LEFT_WINDOW: 0.0, EVICTED: 0.0}
    # The needle sits well before the question's end, out of a 16-token window.
    assert window["reachable"] == 0.0 and window["tokens"][LEFT_WINDOW] == 1.0
    assert result["configs"]["window only"]["per_chunk"] == 0


def test_needle_routing_refuses_tasks_without_one_needle(model, tokenizer):
    with pytest.raises(ValueError, match="passkey or niah_single, not 'niah_multikey'"):
        needle_routing(model, tokenizer, {"default": StillConfig()}, task="niah_multikey")
