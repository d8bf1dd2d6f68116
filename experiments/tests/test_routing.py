import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from experiments.routing import (
    EVICTED,
    LEFT_WINDOW,
    VISIBLE,
    attention_inputs,
    classify,
    fold_times,
    last_query_mass,
    needle_mass,
    needle_positions,
    needle_routing,
    rotated_qk,
)
from linearize.config import StillConfig
from linearize.convert import convert
from linearize.ops.gla_window import GlaWindowOptions
from linearize.ops.gla_window import naive as gla_window
from linearize.ops.still import StillOptions
from linearize.ops.still import naive as still

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


ESSAY = ("The captain walked the deck at night.", "A storm came in from the far sea.",
         "The crew hauled the old rope in the morning wind.")


@pytest.mark.parametrize(("task", "variant"), [("passkey", None), ("niah_single", None), ("niah_single", 3)])
def test_needle_routing_reports_reach_and_fates(model, tokenizer, task, variant):
    configs = {"keep all": StillConfig(**SMALL, budget=16 + 1024, max_chunks=128),
               "window only": StillConfig(**SMALL, budget=16)}
    result = needle_routing(model, tokenizer, configs, task=task, variant=variant, essay=ESSAY, lengths=[600],
                            depths=[0, 50])
    assert result["variant"] == (None if task == "passkey" else variant or 1)
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
    with pytest.raises(ValueError, match="passkey or niah_single, not 'niah_multikey'"):
        needle_mass(model, tokenizer, task="niah_multikey")
    with pytest.raises(ValueError, match="only niah_single has variants, not 'passkey'"):
        needle_routing(model, tokenizer, {"default": StillConfig()}, task="passkey", variant=3)


def test_last_query_mass_is_the_normaliser_of_the_still_output(new_model):
    """Softmax and linear terms, as split here, rebuild the reference's last output row: so the shares
    are the weights the layer really gives each key."""
    student = convert(new_model(), "still", gate=False, **SMALL, budget=16 + 24, max_chunks=3)
    attn = student.model.layers[0].self_attn
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 200, 16), torch.randn(1, 2, 200, 16), torch.randn(1, 2, 200, 16)
    with torch.no_grad():
        mass = last_query_mass({"q": q, "k": k}, attn)
        state = still.init_state(1, 4, 2, attn.features, 16, 16, attn.cfg.slots, device="cpu")
        y, _ = still.still_parallel(q, k, v, torch.ones(1, 200, dtype=torch.bool), None, state, attn.feature_map_q,
                                    attn.feature_map_k, StillOptions(**attn.cfg.op_options(attn.scaling)), start=0,
                                    fresh=True, keep_state=False)
    weights = mass["softmax"] + mass["linear"]
    assert (mass["linear"] > 0).any() and (mass["softmax"] > 0).sum(-1).eq(16 + 24).all()
    expected = torch.einsum("hl,hld->hd", weights, v[0].repeat_interleave(2, dim=0))
    expected = expected / (weights.sum(-1, keepdim=True) + attn.cfg.eps)
    torch.testing.assert_close(expected, y[0, :, -1])


def test_needle_mass_of_a_teacher_and_of_still(model, new_model, tokenizer):
    teacher = needle_mass(model, tokenizer, lengths=[600], depths=[0, 50])["results"]["600"]
    assert teacher["linear"]["best"] == 0.0 and teacher["needle_linear"]["best"] == 0.0
    assert teacher["needle"] == teacher["needle_softmax_only"]
    assert 0 < teacher["needle"]["best"] <= 1
    # Every token softmax-visible: an unconverted-equivalent student, the teacher's attention exactly.
    keep_all = convert(new_model(), "still", **SMALL, budget=16 + 1024, max_chunks=128)
    kept = needle_mass(keep_all, tokenizer, lengths=[600], depths=[0, 50])["results"]["600"]
    assert kept["linear"]["best"] == 0.0
    torch.testing.assert_close(kept["needle"]["by_layer"], teacher["needle"]["by_layer"])
    # A window only: the needle is folded, its softmax share gone; what it keeps is linear weight.
    window = convert(new_model(), "still", **SMALL, budget=16)
    folded = needle_mass(window, tokenizer, lengths=[600], depths=[0, 50])["results"]["600"]
    assert folded["needle_softmax_only"]["best"] == 0.0
    assert 0 < folded["needle_linear"]["best"] == folded["needle"]["best"] < folded["linear"]["best"] < 1


def test_last_query_mass_is_the_normaliser_of_the_shared_lizard_output(new_model):
    student = convert(new_model(), "lizard", combine="shared", window=16, num_sinks=2)
    attn = student.model.layers[0].self_attn
    torch.manual_seed(0)
    with torch.no_grad():
        attn.sinks.normal_()
        q, k, v = torch.randn(1, 4, 200, 16), torch.randn(1, 2, 200, 16), torch.randn(1, 2, 200, 16)
        log_g = -torch.rand(1, 4, 200, 1) * 0.05  # a gate that forgets visibly over 200 tokens
        fq, fk = attn.feature_map_q(q), attn.feature_map_k(k.repeat_interleave(2, dim=1))
        inputs = {"q": q, "k": k, "fq": fq, "fk": fk, "qw": q, "kw": k, "log_g": log_g}
        mass = last_query_mass(inputs, attn)
        state = gla_window.init_state(1, 4, 2, attn.features, 16, 16, device="cpu")
        y, _ = gla_window.gla_window_parallel(fq, fk, log_g, q, k, v, torch.ones(1, 200, dtype=torch.bool), state,
                                              GlaWindowOptions(window=16, scale=attn.scaling, sinks=attn.sinks,
                                                               alpha=attn.alpha, shared=True, eps=attn.cfg.eps))
    assert (mass["softmax"] > 0).sum(-1).eq(16).all() and (mass["linear"] > 0).all() and (mass["sinks"] > 0).all()
    weights = mass["softmax"] + mass["linear"]
    expected = torch.einsum("hl,hld->hd", weights, v[0].repeat_interleave(2, dim=0))
    expected = expected / (weights.sum(-1, keepdim=True) + mass["sinks"][:, None] + attn.cfg.eps)
    torch.testing.assert_close(expected, y[0, :, -1])


def test_attention_inputs_capture_lizard_branches_in_its_own_call(new_model, tokenizer):
    student = convert(new_model(), "lizard", combine="shared", window=16, rope_in_window=True)
    ids = tokenizer("The whale sailed far into the night. " * 8, return_tensors="pt").input_ids
    captured = attention_inputs(student, ids)
    L = ids.shape[1]
    assert [sorted(c) for c in captured] == [["fk", "fq", "k", "kw", "log_g", "q", "qw"]] * len(captured)
    assert captured[0]["fq"].shape == (1, 4, L, 16) and captured[0]["log_g"].shape == (1, 4, L, 1)
    torch.testing.assert_close(captured[0]["qw"], captured[0]["q"])  # the window's RoPE is the teacher's
    torch.testing.assert_close(captured[0]["kw"], captured[0]["k"])
    assert not any(name in vars(layer.self_attn) for layer in student.model.layers
                   for name in ("branch_inputs", "log_gate"))
    lizard = needle_mass(student, tokenizer, lengths=[600], depths=[0, 50])["results"]["600"]
    # The needle lies far outside a 16-token window: it gets linear weight only.
    assert lizard["needle_softmax_only"]["best"] == 0.0
    assert 0 < lizard["needle_linear"]["best"] == lizard["needle"]["best"] < 1


def test_needle_mass_refuses_what_it_cannot_split(new_model, tokenizer):
    with pytest.raises(TypeError, match="STILL, Lizard and softmax layers, not LolcatsAttention"):
        needle_mass(convert(new_model(), "lolcats"), tokenizer, lengths=[600], depths=[0])
    with pytest.raises(TypeError, match="combine='alpha': its two branches normalise apart"):
        needle_mass(convert(new_model(), "lizard"), tokenizer, lengths=[600], depths=[0])
