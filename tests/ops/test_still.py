"""The STILL op: parallel form == recurrence (values, gradients, routing state) and the routing rule."""

import itertools
from typing import get_args, get_type_hints

import pytest
import torch

from linearize.config import ConfigError, StillConfig, make_method_config
from linearize.feature_maps import NormPreservingFeatureMap
from linearize.ops.common import exp_weights, repeat_kv
from linearize.ops.still import StillOptions
from linearize.ops.still import naive as still
from linearize.ops.still import routing as still_routing

B, H, HKV, D, F = 2, 4, 2, 8, 3


def setup(L, seed=0, gate=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, D, generator=g, dtype=torch.float64).requires_grad_() for h in (H, HKV, HKV))
    gate_t = torch.rand(B, H, L, D, generator=g, dtype=torch.float64).requires_grad_() if gate else None
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[1, :3] = False
    torch.manual_seed(seed)
    phi_q, phi_k = NormPreservingFeatureMap(H, D, F).double(), NormPreservingFeatureMap(H, D, F).double()
    return (q, k, v, gate_t), valid, phi_q, phi_k


def state0(window, budget):
    return still.init_state(B, H, HKV, 2 * F, D, window, budget - window, device="cpu", dtype=torch.float64)


def run_steps(q, k, v, gate, valid, phi_q, phi_k, opts, window, budget):
    state, ys, soft_sizes = state0(window, budget), [], []
    for t in range(q.shape[2]):
        sl = slice(t, t + 1)
        y, state = still.still_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], valid[:, sl],
                                    None if gate is None else gate[:, :, sl], state, phi_q, phi_k, options=StillOptions(**opts))
        ys.append(y)
        soft_sizes.append(state["sal_used"].sum(-1) + state["win_valid"][:, None, :].sum(-1) + 1)
    return torch.cat(ys, 2), state, torch.stack(soft_sizes)


# `make test`: every length and shape under the default routing, every routing at one of them; the rest
# in `make test-all`.
PARALLEL_CASES = [(L, routing, *shape, fresh) for L in (1, 7, 16, 29) for routing in still_routing.ROUTINGS
                  for shape in [(4, 4, 10, 2), (8, 4, 14, 1), (4, 2, 4, 3)]
                  for fresh in (False, True)]  # fresh: the empty slots and window are left out


def _fast_parallel_case(L, routing, window, chunk, budget, max_chunks, fresh) -> bool:
    return routing == still_routing.ROUTINGS[0] or (L == 29 and (window, budget) == (4, 10) and fresh)


@pytest.mark.parametrize("L,routing,window,chunk,budget,max_chunks,fresh", [
    pytest.param(*case, marks=() if _fast_parallel_case(*case) else pytest.mark.slow) for case in PARALLEL_CASES])
def test_parallel_equals_recurrent(L, routing, window, chunk, budget, max_chunks, fresh):
    (q, k, v, gate), valid, phi_q, phi_k = setup(L)
    opts = {"window": window, "chunk": chunk, "per_chunk": (budget - window) // max_chunks, "routing": routing, "scale": D**-0.5}
    y_par, s_par = still.still_parallel(q, k, v, valid, gate, state0(window, budget), phi_q, phi_k, start=0, options=StillOptions(**opts),
                                        fresh=fresh)
    y_rec, s_rec, _ = run_steps(q, k, v, gate, valid, phi_q, phi_k, opts, window, budget)
    torch.testing.assert_close(y_par, y_rec, atol=1e-9, rtol=1e-8)
    # A pass that fills no cache skips the state: the same output, exactly.
    y_alone, no_state = still.still_parallel(q, k, v, valid, gate, state0(window, budget), phi_q, phi_k, start=0,
                                             options=StillOptions(**opts), fresh=fresh, keep_state=False)
    assert no_state is None
    torch.testing.assert_close(y_alone, y_par, atol=0, rtol=0)
    for name in s_par:
        torch.testing.assert_close(s_par[name], s_rec[name], atol=1e-9, rtol=1e-8)
    w = torch.randn_like(y_par)
    params = [q, k, v, gate, phi_q.reflector, phi_k.weight]
    for a, b in zip(torch.autograd.grad((y_par * w).sum(), params, allow_unused=True, materialize_grads=True),
                    torch.autograd.grad((y_rec * w).sum(), params, allow_unused=True, materialize_grads=True)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-8)


@pytest.mark.parametrize("routing", still_routing.ROUTINGS)
def test_parallel_continues_from_a_state(routing):
    (q, k, v, gate), valid, phi_q, phi_k = setup(23)
    opts = {"window": 4, "chunk": 2, "per_chunk": 2, "routing": routing, "scale": D**-0.5}
    full, _ = still.still_parallel(q, k, v, valid, gate, state0(4, 9), phi_q, phi_k, start=0, options=StillOptions(**opts))
    cut = lambda x, s: None if x is None else x[:, :, s]
    a, state = still.still_parallel(cut(q, slice(0, 9)), cut(k, slice(0, 9)), cut(v, slice(0, 9)), valid[:, :9],
                                    cut(gate, slice(0, 9)), state0(4, 9), phi_q, phi_k, start=0, options=StillOptions(**opts))
    b, _ = still.still_parallel(cut(q, slice(9, None)), cut(k, slice(9, None)), cut(v, slice(9, None)), valid[:, 9:],
                                cut(gate, slice(9, None)), state, phi_q, phi_k, start=9, options=StillOptions(**opts))
    torch.testing.assert_close(torch.cat([a, b], 2), full, atol=1e-9, rtol=1e-8)


def test_softmax_set_never_exceeds_budget():
    (q, k, v, gate), valid, phi_q, phi_k = setup(64, gate=False)
    window, budget = 8, 14
    opts = {"window": window, "chunk": 4, "per_chunk": 3, "routing": "saliency", "scale": D**-0.5}
    _, state, sizes = run_steps(q, k, v, gate, valid, phi_q, phi_k, opts, window, budget)
    assert sizes.max() == budget  # full after enough chunks, and never more
    assert state["sal_used"].all()


def test_route_departure_evicts_the_lowest_score_oldest_first():
    slots = {"score": torch.tensor([[[3.0, 1.0, 1.0, 5.0]]]), "pos": torch.tensor([[[10, 7, 4, 2]]]),
             "used": torch.ones(1, 1, 4, dtype=torch.bool)}
    slot, victim, fold_cand, new = still_routing.route_departure(slots, torch.tensor([[2.0]]), torch.tensor([[20]]),
                                                                 torch.tensor([[True]]))
    assert slot.item() == 2 and victim.item() and not fold_cand.item()  # score 1.0 at pos 4 is the oldest lowest
    assert new["score"].tolist() == [[[3.0, 1.0, 2.0, 5.0]]] and new["pos"][0, 0, 2] == 20
    slot, victim, fold_cand, _ = still_routing.route_departure(slots, torch.tensor([[0.5]]), torch.tensor([[20]]),
                                                               torch.tensor([[True]]))
    assert slot.item() == -1 and not victim.item() and fold_cand.item()  # the newcomer is the lowest: folded


def test_select_chunk_keeps_top_scores_and_skips_padding():
    scores = torch.tensor([[[0.1, 0.9, 0.5, 0.7]]])
    valid = torch.tensor([[[True, False, True, True]]])
    assert still_routing.select_chunk(scores, valid, 2).tolist() == [[[False, False, False, True]]]


def test_saliency_score_is_high_for_self_attending_tokens():
    """A query that matches only its own key depends on itself: its score beats a uniform one."""
    keys = torch.zeros(1, 1, 4, D, dtype=torch.float64)
    keys[0, 0, 3, 0] = 10.0
    q = torch.zeros(1, 1, 2, D, dtype=torch.float64)
    q[0, 0, 1, 0] = 1.0  # token 3 attends to itself, token 2 (q = 0) attends uniformly
    valid = torch.ones(1, 4, dtype=torch.bool)
    scores = still_routing.saliency_scores(q, keys, valid, valid[:, 2:], chunk=4, scale=1.0, eps=1e-6)
    assert scores[0, 0, 1] > scores[0, 0, 0] > 0


@pytest.mark.parametrize("L,P,chunk", [(1, 4, 4), (7, 10, 4), (29, 32, 4), (16, 16, 8), (33, 40, 2)])
@pytest.mark.parametrize("routing", still_routing.LOCAL_ROUTINGS)
def test_banded_saliency_equals_the_full_one(L, P, chunk, routing):
    g = torch.Generator().manual_seed(L)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    keys = torch.randn(B, HKV, P, D, generator=g, dtype=torch.float64)
    key_valid = torch.ones(B, P, dtype=torch.bool)
    key_valid[1, : P - L + 3] = False  # a left-padded row
    opts = {"chunk": chunk, "scale": D**-0.5, "eps": 1e-6, "routing": routing}
    full = still_routing.saliency_scores(q, keys, key_valid, key_valid[:, P - L :], **opts)
    banded = still_routing.banded_saliency_scores(q, keys, key_valid, key_valid[:, P - L :], **opts)
    torch.testing.assert_close(banded, full, atol=1e-12, rtol=1e-10)


def scores_of(routing, q, keys, key_valid, valid, chunk=4, scale=1.0):
    """`token_scores` of the last q.shape[2] tokens of `keys`, as a form calls it."""
    positions = valid.long().cumsum(1) - 1
    return still_routing.token_scores(q, keys, key_valid, valid, positions, routing=routing, chunk=chunk,
                                      scale=scale, eps=1e-6)


def test_diagonal_score_is_the_attention_to_itself_in_the_local_window():
    """Four keys, the second padding (the last three are new, over a window of 4). Token 3's query
    matches only its own key: e^10 / (e^10 + 2) over its visible keys 0, 2, 3; token 2's query is 0,
    so it attends its keys 0 and 2 uniformly: 1/2; token 1, padding: -inf."""
    keys = torch.zeros(1, 1, 4, D, dtype=torch.float64)
    keys[0, 0, 3, 0] = 10.0
    q = torch.zeros(1, 1, 3, D, dtype=torch.float64)
    q[0, 0, 2, 0] = 1.0
    valid = torch.tensor([[False, True, True]])
    key_valid = torch.tensor([[True, False, True, True]])
    score = scores_of("diagonal", q, keys, key_valid, valid)[0, 0]
    e10 = torch.tensor(10.0, dtype=torch.float64).exp()
    assert score[0] == float("-inf")
    torch.testing.assert_close(score[1:], torch.stack([torch.tensor(0.5, dtype=torch.float64), e10 / (e10 + 2)]))


@pytest.mark.parametrize("n_rep", [1, 4])
def test_diagonal_ranks_as_saliency_within_a_query_head(n_rep):
    """Self-Saliency is, up to eps, (1 - a) log(1 - a) + a log((a + eps) / eps) of a = a^diag_{t,t}: an
    increasing function, so with one query head a KV head both rules pick the same tokens; with
    several, they differ only through the mean over the group (docs/methods.md)."""
    g = torch.Generator().manual_seed(0)
    C, L = 64, 256  # STILL's chunk, 12 picks each
    q = torch.randn(2, 2 * n_rep, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, L, D, generator=g, dtype=torch.float64)
    valid = torch.ones(2, L, dtype=torch.bool)
    picks = {}
    for routing in still_routing.LOCAL_ROUTINGS:
        scores = scores_of(routing, q, k, valid, valid, chunk=C, scale=D**-0.5).unflatten(-1, (-1, C))
        picks[routing] = still_routing.select_chunk(scores, torch.ones_like(scores, dtype=torch.bool), 12)
    same = (picks["saliency"] == picks["diagonal"]).all(-1)
    assert same.all() if n_rep == 1 else not same.all()


def test_dot_key_norm_and_uniform_scores_on_hand_made_keys():
    """`dot`: q_t.k_t * scale, averaged over the query heads of each KV head (heads 2h, 2h + 1 share KV
    head h); `key_norm`: ||k_t|| of the KV head's key; both rounded to SELF_SCORE_QUANTUM; `uniform`:
    0; -inf at padding; only the new tokens (the last 5 of the combined 7) are scored."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 5, D, generator=g, dtype=torch.float64)
    keys = torch.randn(B, HKV, 7, D, generator=g, dtype=torch.float64)
    valid = torch.ones(B, 5, dtype=torch.bool)
    valid[1, :2] = False
    key_valid = torch.cat([torch.ones(B, 2, dtype=torch.bool), valid], 1)
    new = keys[:, :, 2:]
    pad = ~valid[:, None, :]
    dot = torch.stack([(q[:, 2 * h : 2 * h + 2] * new[:, h : h + 1]).sum(-1).mean(1) for h in range(HKV)], 1) * 0.5
    expected = {"dot": dot, "key_norm": new.square().sum(-1).sqrt(), "uniform": torch.zeros(B, HKV, 5).double()}
    quantum = still_routing.SELF_SCORE_QUANTUM
    for routing, want in expected.items():
        got = scores_of(routing, q, keys, key_valid, valid, scale=0.5)
        want = (want / quantum).round() * quantum
        torch.testing.assert_close(got, want.masked_fill(pad, float("-inf")), atol=0, rtol=0, msg=routing)
        step = torch.cat([scores_of(routing, q[:, :, t : t + 1], keys[:, :, : 3 + t], key_valid[:, : 3 + t],
                                    valid[:, t : t + 1], scale=0.5) for t in range(5)], 2)
        torch.testing.assert_close(step, got, atol=0, rtol=0, msg=routing)  # one token at a time, as a step


@pytest.mark.parametrize("routing", ["dot", "key_norm"])
def test_a_token_ties_with_its_copies_under_rope(routing):
    """RoPE turns q_t and k_t by the same angle, so q_t.k_t and ||k_t|| do not depend on where the token
    stands; rounded, the copies of one token tie exactly in float32 (the tie rule then decides, the
    same in every form), where their raw values differ in the last bits."""
    g = torch.Generator().manual_seed(0)
    q0, k0 = torch.randn(1, H, 1, D, generator=g), torch.randn(1, HKV, 1, D, generator=g)
    angles = torch.arange(40, dtype=torch.float32)[:, None] * 10000.0 ** (-torch.arange(D // 2) / (D // 2))
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)

    def rope(x):
        half = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
        return x * cos + half * sin

    q, k = rope(q0), rope(k0)  # one token at positions 0..39
    valid = torch.ones(1, 40, dtype=torch.bool)
    raw = (q * repeat_kv(k, H // HKV)).sum(-1) if routing == "dot" else k.norm(dim=-1)
    assert (raw != raw[..., :1]).any()  # float32 tells the copies apart
    score = scores_of(routing, q, k, valid, valid, scale=D**-0.5)
    assert (score == score[..., :1]).all()


def route(routing, k, window=4, chunk=4, per_chunk=1, slots=2):
    """The salient slots' positions after a pass over k ([1, HKV, L, D]), sorted, per KV head."""
    L = k.shape[2]
    q = torch.randn(1, H, L, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    state = still.init_state(1, H, HKV, 2 * F, D, window, slots, device="cpu", dtype=torch.float64)
    phi = NormPreservingFeatureMap(H, D, F).double()
    opts = {"window": window, "chunk": chunk, "per_chunk": per_chunk, "routing": routing, "scale": D**-0.5}
    with torch.no_grad():
        _, state = still.still_parallel(q, k, k, torch.ones(1, L, dtype=torch.bool), None, state, phi, phi, start=0,
                                        options=StillOptions(**opts))
    assert state["sal_used"].all()
    return state["sal_pos"][0].sort(-1).values.tolist()


def test_key_norm_routes_the_largest_keys_into_the_salient_slots():
    """Chunks of 4 pick 1 token each; of the 3 chunks that left the window (15 tokens, window 4: tokens
    0-11), the 2 slots keep the picks with the largest norms: per head one key of each chunk is made
    large, chunk 1's the largest, chunk 0's the smallest (so it is evicted)."""
    k = 0.1 * torch.randn(1, HKV, 15, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    big = {0: [(1, 2.0), (6, 4.0), (9, 3.0)], 1: [(3, 2.0), (4, 4.0), (10, 3.0)]}  # head: (position, norm)
    for h, picks in big.items():
        for p, norm in picks:
            k[0, h, p] = norm * torch.nn.functional.normalize(k[0, h, p], dim=-1)
    assert route("key_norm", k) == [[6, 9], [4, 10]]


def test_uniform_picks_each_chunks_earliest_and_recency_its_latest():
    """Equal scores fall to the tie rules: a chunk picks its earliest tokens (stable sort) and full slots
    evict their oldest, so `uniform` keeps the first token of the last 2 chunks that left the window
    (15 tokens, window 4: tokens 0-11); `recency` (the position as score) the last token of each."""
    k = torch.randn(1, HKV, 15, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert route("uniform", k) == [[4, 8]] * HKV
    assert route("recency", k) == [[7, 11]] * HKV


@pytest.mark.parametrize("routing", still_routing.ROUTINGS)
def test_fresh_routing_gives_the_parallel_forms_state(routing):
    """The kernels' routing (`fresh_routing`: fold times and the state after a prefill) is the parallel
    form's, slots overflowing: the state equal, and the fold times what the state's linear part holds."""
    (q, k, v, gate), valid, phi_q, phi_k = setup(29)
    opts = {"window": 4, "chunk": 4, "per_chunk": 3, "routing": routing, "scale": D**-0.5, "eps": 1e-6}
    with torch.no_grad():
        _, s_par = still.still_parallel(q, k, v, valid, gate, state0(4, 10), phi_q, phi_k, start=0, fresh=True,
                                        options=StillOptions(**opts))
        fk = phi_k(repeat_kv(k, H // HKV))
        fold, s_fresh = still_routing.fresh_routing(q, k, v, valid, state0(4, 10), start=0, fk=fk, options=StillOptions(**opts))
    for name in s_par:
        torch.testing.assert_close(s_fresh[name], s_par[name], atol=1e-12, rtol=1e-10, msg=name)
    folded = repeat_kv((fold != still_routing.NEVER) & valid[:, None, :], H // HKV)  # start 0: NEVER stays visible
    torch.testing.assert_close(s_fresh["z"], (fk * folded[..., None]).sum(2))


def test_an_unknown_routing_is_refused_naming_the_choices():
    (q, k, v, gate), valid, phi_q, phi_k = setup(5)
    opts = {"window": 4, "chunk": 4, "per_chunk": 2, "routing": "keynorm", "scale": D**-0.5}
    choices = "saliency, diagonal, dot, key_norm, uniform, random, recency, got 'keynorm'"
    with pytest.raises(ValueError, match=f"^routing must be one of {choices}$"):
        still.still_parallel(q, k, v, valid, gate, state0(4, 10), phi_q, phi_k, start=0, options=StillOptions(**opts))
    with pytest.raises(ValueError, match=f"^routing must be one of {choices}$"):
        still.still_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], valid[:, :1], gate[:, :, :1], state0(4, 10), phi_q,
                         phi_k, options=StillOptions(**opts))
    with pytest.raises(ConfigError, match=f"^routing must be one of {choices}$"):
        make_method_config("still", routing="keynorm")
    assert get_args(get_type_hints(StillConfig)["routing"]) == still_routing.ROUTINGS


def test_selecting_all_completed_chunks_at_once_equals_one_by_one():
    g = torch.Generator().manual_seed(3)
    W1, L, chunk, per_chunk = 5, 37, 4, 2
    scores = torch.randint(0, 5, (B, HKV, W1 + L), generator=g).double()  # ties included
    key_valid = torch.ones(B, W1 + L, dtype=torch.bool)
    key_valid[1, : W1 + 6] = False
    chosen = torch.rand(B, HKV, W1 + L, generator=g) < 0.3
    count = torch.tensor([3, 0])
    positions = count[:, None] + key_valid[:, W1:].long().cumsum(1) - 1
    completes = key_valid[:, W1:] & ((positions + 1) % chunk == 0)
    at_once = chosen.clone()
    still_routing._select_completed_chunks(at_once, scores, key_valid, completes, W1, chunk, per_chunk)
    for i in range(L):
        still_routing._select_if_complete(chosen, scores, key_valid, W1 + i, completes[:, i], chunk, per_chunk)
    assert torch.equal(at_once, chosen)


def test_routing_without_eviction_takes_the_vectorized_path(monkeypatch):
    """Within the budget no token is evicted: routing is computed at once, and still equals the recurrence."""
    (q, k, v, gate), valid, phi_q, phi_k = setup(12)
    opts = {"window": 4, "chunk": 4, "per_chunk": 2, "routing": "saliency", "scale": D**-0.5}
    calls = []
    real = still_routing.route_departure
    monkeypatch.setattr(still_routing, "route_departure", lambda *a: calls.append(1) or real(*a))
    y_par, s_par = still.still_parallel(q, k, v, valid, gate, state0(4, 16), phi_q, phi_k, start=0, options=StillOptions(**opts))
    assert not calls and s_par["sal_used"].any()
    monkeypatch.setattr(still_routing, "route_departure", real)
    y_rec, s_rec, _ = run_steps(q, k, v, gate, valid, phi_q, phi_k, opts, 4, 16)
    torch.testing.assert_close(y_par, y_rec, atol=1e-9, rtol=1e-8)
    for name in s_par:
        torch.testing.assert_close(s_par[name], s_rec[name], atol=1e-9, rtol=1e-8)


def count_eviction_replays(monkeypatch) -> list:
    """A list that grows by one at each call of the routing's eviction replay."""
    calls = []
    real = still_routing._replay_with_eviction
    monkeypatch.setattr(still_routing, "_replay_with_eviction", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def forbid_host_reads(monkeypatch):
    """Fail the test at any read of a tensor's value into Python (a host sync on a GPU)."""
    for read in ("__bool__", "__int__", "__float__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, read, lambda *a, read=read: pytest.fail(f"host read of a tensor ({read})"))


def test_fresh_pass_that_may_overflow_replays_without_a_host_check(monkeypatch):
    """A fresh pass whose picks could exceed the slots replays the eviction without asking whether they
    do (a host sync), and equals the recurrence also where they fit (here 3 chunks of 2 picks, 5 slots)."""
    (q, k, v, gate), valid, phi_q, phi_k = setup(12)
    opts = {"window": 4, "chunk": 4, "per_chunk": 2, "routing": "saliency", "scale": D**-0.5}
    calls = count_eviction_replays(monkeypatch)
    forbid_host_reads(monkeypatch)
    y_par, s_par = still.still_parallel(q, k, v, valid, gate, state0(4, 9), phi_q, phi_k, start=0, fresh=True, options=StillOptions(**opts))
    # The kernels' routing.
    fold, _ = still_routing.fresh_routing(q, k, v, valid, state0(4, 9), start=0, options=StillOptions(**opts, eps=1e-6))
    monkeypatch.undo()
    assert len(calls) == 2 and fold.shape == (B, HKV, 12)
    y_rec, s_rec, _ = run_steps(q, k, v, gate, valid, phi_q, phi_k, opts, 4, 9)
    torch.testing.assert_close(y_par, y_rec, atol=1e-9, rtol=1e-8)
    for name in s_par:
        torch.testing.assert_close(s_par[name], s_rec[name], atol=1e-9, rtol=1e-8)


def test_continued_call_while_capturing_replays_without_a_host_check(monkeypatch):
    """A continued call asks whether its picks fit the slots (a host read) except while a CUDA graph is
    being captured, where it replays the eviction unchecked: the same outputs and state either way."""
    (q, k, v, gate), valid, phi_q, phi_k = setup(16)
    opts = {"window": 4, "chunk": 4, "per_chunk": 2, "routing": "saliency", "scale": D**-0.5}
    _, state = still.still_parallel(q[:, :, :8], k[:, :, :8], v[:, :, :8], valid[:, :8], gate[:, :, :8],
                                    state0(4, 16), phi_q, phi_k, start=0, options=StillOptions(**opts))

    def second_half():
        return still.still_parallel(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], valid[:, 8:], gate[:, :, 8:], state,
                                    phi_q, phi_k, start=8, fresh=False, options=StillOptions(**opts))

    y_checked, s_checked = second_half()
    calls = count_eviction_replays(monkeypatch)
    monkeypatch.setattr(still_routing, "capturing", lambda t: True)
    forbid_host_reads(monkeypatch)
    y_captured, s_captured = second_half()
    monkeypatch.undo()
    assert calls and s_checked["sal_used"].any()
    torch.testing.assert_close(y_captured, y_checked, atol=1e-12, rtol=0)
    for name in s_checked:
        torch.testing.assert_close(s_captured[name], s_checked[name], atol=1e-12, rtol=0)


def test_continued_call_stores_positions_by_the_states_clock_not_the_python_start():
    """A CUDA graph replays a call with the `start` it was captured at: the outputs and the state after
    it (the slots' positions included) must not depend on that number, only on the state's clock."""
    (q, k, v, gate), valid, phi_q, phi_k = setup(24)
    opts = {"window": 4, "chunk": 4, "per_chunk": 2, "routing": "saliency", "scale": D**-0.5}
    _, state = still.still_parallel(q[:, :, :8], k[:, :, :8], v[:, :, :8], valid[:, :8], gate[:, :, :8],
                                    state0(4, 9), phi_q, phi_k, start=0, options=StillOptions(**opts))
    runs = [still.still_parallel(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], valid[:, 8:], gate[:, :, 8:], state,
                                 phi_q, phi_k, start=start, fresh=False, options=StillOptions(**opts)) for start in (8, 40)]
    (y, after), (y_frozen, after_frozen) = runs
    assert after["sal_used"].any() and after["sal_pos"].max() >= 8  # slots were taken in the call
    torch.testing.assert_close(y_frozen, y, atol=0, rtol=0)
    for name in after:
        torch.testing.assert_close(after_frozen[name], after[name], atol=0, rtol=0, msg=name)


def route_one_by_one(state, scores, chosen, positions, start, L):
    """The routing as `still_step` does it: `route_departure` once per departing token."""
    B, Hkv, K = state["sal_used"].shape
    slot_ids = torch.arange(K).expand(B, Hkv, K)
    slots = {"score": state["sal_score"], "pos": state["sal_pos"], "used": state["sal_used"]}
    fold_time = torch.full((B, Hkv, K + L), still_routing.NEVER, dtype=torch.long)
    for i in range(L):
        slot, victim, fold_cand, slots = still_routing.route_departure(slots, scores[..., i],
                                                                       positions[i].expand(B, Hkv), chosen[..., i])
        index = slot.clamp_min(0)[..., None]
        victim_id = slot_ids.gather(-1, index)
        fold_time[..., K + i] = torch.where(fold_cand, start + i + 1, still_routing.NEVER)
        previous = fold_time.gather(-1, victim_id)
        fold_time.scatter_(-1, victim_id, torch.where(victim[..., None], start + i + 1, previous))
        slot_ids = slot_ids.scatter(-1, index, torch.where(slot[..., None] >= 0, K + i, victim_id))
    return fold_time, slot_ids, slots


@pytest.mark.parametrize("seed, K", [(seed, 5) for seed in range(6)] + [(6, 12), (7, 12), (8, 14)])
def test_eviction_replay_equals_routing_one_by_one(seed, K):
    """Ties in score, slots partly free at the start, chains of victims: all as `route_departure` does."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, W1, L, start = 2, 3, 3, 40, 17
    state = {"sal_used": torch.rand(B, Hkv, K, generator=g) < 0.6,
             "sal_score": torch.randint(0, 4, (B, Hkv, K), generator=g).double(),
             "sal_pos": torch.stack([torch.randperm(start - W1, generator=g)[:K] for _ in range(B * Hkv)]).view(B, Hkv, K),
             "win_k": torch.zeros(B, Hkv, W1, 1)}
    scores = torch.randint(0, 4, (B, Hkv, W1 + L), generator=g).double()
    chosen = torch.rand(B, Hkv, W1 + L, generator=g) < 0.5
    positions = torch.arange(start - W1, start + L)
    fold, ids, slots = still_routing._replay_with_eviction(state, scores, chosen, positions, start, L)
    ref_fold, ref_ids, ref_slots = route_one_by_one(state, scores, chosen, positions, start, L)
    assert torch.equal(fold[..., : K + L], ref_fold) and (fold[..., K + L :] == still_routing.NEVER).all()
    assert torch.equal(ids, ref_ids)
    for name in ref_slots:
        assert torch.equal(slots[name], ref_slots[name]), name


def test_folds_within_says_when_the_linear_state_gets_tokens():
    """No token reaches S where `folds_within` says so; one always does once a whole chunk has left the
    window with fewer picks than tokens, or once more tokens came than the budget holds."""
    for window, chunk, budget, max_chunks, L in itertools.product([4, 8], [2, 4], [8, 12, 20], [1, 2, 4],
                                                                  [6, 9, 13, 17, 21, 25]):
        if budget < window:
            continue
        cfg = StillConfig(window=window, chunk_size=chunk, budget=budget, max_chunks=max_chunks)
        (q, k, v, _), _, phi_q, phi_k = setup(L, gate=False)
        opts = {"window": window, "chunk": chunk, "per_chunk": cfg.per_chunk, "routing": "saliency", "scale": D**-0.5}
        with torch.no_grad():
            _, state = still.still_parallel(q, k, v, torch.ones(B, L, dtype=torch.bool), None, state0(window, budget),
                                            phi_q, phi_k, start=0, options=StillOptions(**opts))
        folded = bool(state["S"].ne(0).any())
        assert folded or not (L > budget or (cfg.per_chunk < chunk and L >= window + chunk)), (cfg, L)
        assert cfg.folds_within(L) or not folded, (cfg, L)


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["saliency", "recency", "diagonal", "dot", "key_norm", "uniform"])
def test_inductor_compiled_step_equals_the_eager_one_as_slots_overflow(routing):
    """`StaticDecoder` runs `still_step` through inductor: its generated code must route as the eager
    step does, step after step, once the slots are full and evict (inductor gets the prefill's
    eviction search wrong on this CPU: scripts/check_compiled_routing.py)."""
    L, window, chunk, budget, max_chunks = 29, 4, 4, 10, 2
    (q, k, v, gate), valid, phi_q, phi_k = setup(L, seed=5)
    opts = {"window": window, "chunk": chunk, "per_chunk": (budget - window) // max_chunks, "routing": routing,
            "scale": D**-0.5}
    compiled = torch.compile(still.still_step, backend="inductor")
    eager_state = compiled_state = state0(window, budget)
    evicted = False
    with torch.no_grad():
        for t in range(L):
            step = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], valid[:, t : t + 1], gate[:, :, t : t + 1])
            y, eager_state = still.still_step(*step, eager_state, phi_q, phi_k, options=StillOptions(**opts))
            y_c, compiled_state = compiled(*step, compiled_state, phi_q, phi_k, options=StillOptions(**opts))
            torch.testing.assert_close(y_c, y, atol=1e-10, rtol=1e-9)
            for name in eager_state:
                torch.testing.assert_close(compiled_state[name], eager_state[name], atol=1e-10, rtol=1e-9)
            evicted |= bool(eager_state["sal_used"].all()) and t > budget
    assert evicted


def _combined_attention(q, fq, keys, values, fk, fold, key_valid, scale, eps):
    """What the fresh-pass kernel computes over a combined sequence, in PyTorch: query row i sees key
    j <= i, with softmax while i < fold[j], linear from fold[j] on; y_soft, y_lin over den (with eps)."""
    n_rep = q.shape[1] // keys.shape[1]
    N = q.shape[2]
    i = torch.arange(N)[:, None]
    j = torch.arange(N)[None, :]
    ft, ok = repeat_kv(fold, n_rep)[:, :, None, :], repeat_kv(key_valid, n_rep)[:, :, None, :]
    seen = (j <= i) & ok
    soft, lin = seen & (i < ft), seen & (ft <= i)
    scores = (q @ repeat_kv(keys, n_rep).transpose(-1, -2)) * scale
    weights, _ = exp_weights(scores.masked_fill(~soft, float("-inf")))
    lam = (fq @ fk.transpose(-1, -2)) * lin
    den = weights.sum(-1) + lam.sum(-1) + eps
    values = repeat_kv(values, n_rep)
    return (weights @ values) / den[..., None], (lam @ values) / den[..., None], den


@pytest.mark.parametrize("routing", still_routing.ROUTINGS)
@pytest.mark.parametrize("gate", [True, False])
def test_continued_routing_in_combined_indices_gives_the_parallel_form(routing, gate):
    """`continued_routing` (what the kernels take for a call continuing a state): its fold times, as
    indices of the combined sequence [slots, window, new tokens] with zero queries before the new
    ones, under the kernel's masks, plus the carried S and z, give `still_parallel(fresh=False)`'s y,
    and its state is the parallel form's. Slots overflow in both calls; the call starts at 17."""
    (q, k, v, g), valid, phi_q, phi_k = setup(40, gate=gate)
    opts = {"window": 4, "chunk": 4, "per_chunk": 2, "routing": routing, "scale": D**-0.5, "eps": 1e-6}
    cut = slice(0, 17), slice(17, None)
    part = [(q[:, :, s], k[:, :, s], v[:, :, s], valid[:, s], None if g is None else g[:, :, s]) for s in cut]
    with torch.no_grad():
        _, state = still.still_parallel(*part[0], state0(4, 9), phi_q, phi_k, start=0, fresh=True, options=StillOptions(**opts))
        assert state["sal_used"].all()  # full: the next call evicts
        y_ref, s_ref = still.still_parallel(*part[1], state, phi_q, phi_k, start=17, options=StillOptions(**opts))
        qn, kn, vn, valid_n, gn = part[1]
        keys, values, key_valid, fold, fk, s_new = still_routing.continued_routing(qn, kn, vn, valid_n, state, phi_k,
                                                                                   start=17, options=StillOptions(**opts))
        P, L = keys.shape[2] - qn.shape[2], qn.shape[2]
        assert P == 5 + 3 and fold.shape == key_valid.shape == (B, HKV, P + L)
        fq = phi_q(qn)
        zeros = lambda t: torch.cat([t.new_zeros(*t.shape[:2], P, t.shape[3]), t], 2)
        y_soft, y_lin, den = (t[:, :, P:] for t in _combined_attention(zeros(qn), zeros(fq), keys, values, fk, fold,
                                                                       key_valid, opts["scale"], opts["eps"]))
        den = den[..., None]
        lin = den * y_lin + fq @ state["S"]
        y = (den * y_soft + (lin if gn is None else gn * lin)) / (den + (fq @ state["z"][..., None]))
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=1e-10)
    for name in s_ref:
        torch.testing.assert_close(s_new[name], s_ref[name], atol=1e-12, rtol=1e-10, msg=name)
