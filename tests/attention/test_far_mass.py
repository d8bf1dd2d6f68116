"""Stage 1's far weighting (`linearize.attention.far_mass`): the chunked far mass against a full softmax, the
weights and the weighted MSE against hand-written sums, gradients through the student alone, and far_weight 0
giving the plain MSE bit for bit."""

import pytest
import torch
from tiny_models import TINY, TINY_OPTIONS, tiny_teacher
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from linearize.attention.far_mass import far_mass, far_position_weights, weighted_mse
from linearize.convert import convert
from linearize.ops.common import repeat_kv


def naive_far_mass(q, k, scale, reach, softcap=None, allowed=None):
    """Every query's full softmax row, and the sum of its entries reach or more positions back, in loops."""
    B, H, L, _ = q.shape
    k = repeat_kv(k, H // k.shape[1])
    far = torch.zeros(B, H, L, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            logits = (q[b, h].double() @ k[b, h].double().T) * scale
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            for t in range(L):
                seen = [s for s in range(L) if (s <= t if allowed is None else bool(allowed[b, 0, t, s]))]
                if not seen:
                    continue
                probs = torch.softmax(logits[t, seen], dim=0)
                far[b, h, t] = sum(p for s, p in zip(seen, probs) if t - s >= reach)
    return far


@pytest.mark.parametrize("chunk", [1, 3, 5, 64])
@pytest.mark.parametrize("reach", [0, 1, 4])
@pytest.mark.parametrize("softcap", [None, 0.5])
def test_the_chunked_far_mass_is_the_full_softmax_mass_beyond_the_reach(chunk, reach, softcap):
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 11, 8), torch.randn(2, 2, 11, 8)  # grouped-query: 2 query heads a key head
    far = far_mass(q, k, scale=0.5, reach=reach, softcap=softcap, chunk=chunk)
    assert far.shape == (2, 4, 11) and far.dtype == torch.float32
    torch.testing.assert_close(far.double(), naive_far_mass(q, k, 0.5, reach, softcap), rtol=1e-5, atol=1e-6)
    if reach == 0:  # every key seen is far: the whole of each row
        torch.testing.assert_close(far, torch.ones_like(far))
    else:  # the first `reach` queries see nothing that far back
        assert far[..., :reach].abs().max() == 0 and far[..., reach:].min() > 0


def test_a_mask_decides_which_keys_a_query_sees_and_a_query_that_sees_none_has_no_far_mass():
    torch.manual_seed(1)
    q, k = torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4)
    allowed = torch.ones(9, 9, dtype=torch.bool).tril()[None, None].clone()
    allowed[..., 2:] = False  # the first two keys are padding...
    allowed[..., :2, :] = False  # ...and their queries see nothing
    allowed[..., 2:, 2:] = torch.ones(7, 7, dtype=torch.bool).tril()
    far = far_mass(q, k, scale=1.0, reach=3, allowed=allowed, chunk=4)
    torch.testing.assert_close(far.double(), naive_far_mass(q, k, 1.0, 3, allowed=allowed), rtol=1e-5, atol=1e-6)
    assert far[..., :2].abs().max() == 0


def test_the_far_mass_needs_no_gradient_and_refuses_a_negative_reach():
    q, k = torch.randn(1, 2, 5, 4, requires_grad=True), torch.randn(1, 2, 5, 4, requires_grad=True)
    far = far_mass(q, k, scale=1.0, reach=2)
    assert not far.requires_grad and far.grad_fn is None
    with pytest.raises(ValueError, match="reach"):
        far_mass(q, k, scale=1.0, reach=-1)


def test_the_weights_are_one_plus_far_weight_times_the_head_mean_normalised_per_sequence():
    far = torch.tensor([[[0.0, 0.5, 1.0], [0.0, 0.1, 0.3]],   # sequence 0: head means 0, 0.3, 0.65
                        [[0.2, 0.2, 0.2], [0.2, 0.2, 0.2]]])  # sequence 1: the same everywhere
    weights = far_position_weights(far, 2.0)
    raw = torch.tensor([1.0, 1.6, 2.3])
    torch.testing.assert_close(weights[0], raw / raw.mean())
    torch.testing.assert_close(weights[1], torch.ones(3))
    torch.testing.assert_close(weights.mean(-1), torch.ones(2))
    torch.testing.assert_close(far_position_weights(far, 0.0), torch.ones(2, 3))


def test_the_weighted_mse_is_the_hand_computed_weighted_mean_and_its_gradient_reaches_the_student_alone():
    torch.manual_seed(2)
    out = torch.randn(2, 3, 4, requires_grad=True)
    target = torch.randn(2, 3, 4, requires_grad=True)  # a constant to the loss, whatever its flag says
    weights = torch.tensor([[0.5, 1.0, 1.5], [1.2, 0.9, 0.9]], requires_grad=True)
    loss = weighted_mse(out, target, weights)
    by_hand = sum(weights[b, t].item() * (out[b, t, c].item() - target[b, t, c].item()) ** 2
                  for b in range(2) for t in range(3) for c in range(4)) / (2 * 3 * 4)
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    loss.backward()
    assert target.grad is None and weights.grad is None
    expected = 2 * weights.detach()[..., None] * (out.detach() - target.detach()) / out.numel()
    torch.testing.assert_close(out.grad, expected)
    torch.testing.assert_close(weighted_mse(out, target, torch.ones(2, 3)),
                               torch.nn.functional.mse_loss(out, target))


def stage1_losses(method, far_weight, L=24, seed=3):
    """A stage-1 call of a tiny teacher's first linearized layer: (its transfer loss, its own output, the
    teacher's output, the new parameters)."""
    teacher = tiny_teacher()
    attention = convert(teacher, method, **TINY_OPTIONS[method]).model.layers[0].self_attn
    torch.manual_seed(seed)
    hidden = torch.randn(2, L, TINY["hidden_size"])
    position_embeddings = teacher.model.rotary_emb(hidden, torch.arange(L)[None])
    attention.attention_transfer = False
    with torch.no_grad():
        own, _ = attention(hidden, position_embeddings=position_embeddings, attention_mask=None)
    attention.attention_transfer, attention.far_weight = True, far_weight
    target, _ = attention(hidden, position_embeddings=position_embeddings, attention_mask=None)
    return attention.transfer_loss, own, target, attention


@pytest.mark.parametrize("method", ["lizard", "still", "lolcats"])
def test_far_weight_zero_is_the_plain_mse_bit_for_bit(method):
    loss, own, target, _ = stage1_losses(method, 0.0)
    assert torch.equal(loss, torch.nn.functional.mse_loss(own, target))


@pytest.mark.parametrize("method", ["lizard", "still", "lolcats"])
def test_a_far_weight_weights_the_layers_error_by_the_teachers_mass_beyond_its_window(method):
    loss, own, target, attention = stage1_losses(method, 4.0)
    assert attention.softmax_reach() == TINY_OPTIONS[method]["window"]
    # The reference: the teacher's q and k rotated from its own projections, the mass in one full softmax.
    teacher = tiny_teacher()
    torch.manual_seed(3)
    hidden = torch.randn(2, 24, TINY["hidden_size"])
    cos, sin = teacher.model.rotary_emb(hidden, torch.arange(24)[None])
    layer = teacher.model.layers[0].self_attn
    q = layer.q_proj(hidden).view(2, 24, -1, layer.head_dim).transpose(1, 2)
    k = layer.k_proj(hidden).view(2, 24, -1, layer.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    far = naive_far_mass(q.detach(), k.detach(), layer.scaling, TINY_OPTIONS[method]["window"]).float()
    raw = 1 + 4.0 * far.mean(1)
    weights = raw / raw.mean(-1, keepdim=True)
    expected = (weights[..., None] * (own - target.detach()) ** 2).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    assert weights[:, :8].max() < weights[:, 8:].max()  # no key beyond the window of the first 8 queries
    assert not torch.allclose(loss, torch.nn.functional.mse_loss(own, target))
    # The gradient reaches the student's new parameters; the teacher's projections stay frozen targets.
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in attention.new_parameters())


def test_a_sequence_inside_the_window_gets_every_position_alike():
    """Shorter than the window, nothing is far: the weights are all 1 and the loss the plain MSE's value."""
    loss, own, target, _ = stage1_losses("lizard", 4.0, L=8)
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(own, target))
