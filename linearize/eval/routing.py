"""Where STILL's routing leaves a needle: softmax-visible at the question, or folded into the state.

A retrieval prompt is answered from the last prompt token. STILL can copy the needle's tokens from
there only in the (layer, KV head) pairs whose softmax set still holds them; a needle folded into the
linear state survives only as a blur. The routing is discrete and depends on q and k alone, so it is
replayed here from each layer's RoPE'd q and k (`still.fresh_routing`, the rule training, prefill and
decoding share) under any `StillConfig`, without training a model per routing variant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..attention.base import LinearizedAttention, rotate
from ..attention.still import StillAttention
from ..config import StillConfig
from ..ops import still
from ..ops.common import repeat_kv
from .longcontext import build_sample, sample_seed

VISIBLE, LEFT_WINDOW, EVICTED = "visible", "left_window", "evicted"
SINGLE_ANSWER_TASKS = ("passkey", "niah_single")  # one needle string, in a haystack without essays (variant 1)


def rotated_qk(model: nn.Module, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's RoPE'd q [B, H, L, d] and k [B, H_kv, L, d] (float32) in one forward of `model`.

    Works on a teacher (HF attention) and on a linearized model alike: both take the normed hidden
    states and the (cos, sin) position embeddings and own q_proj, k_proj and head_dim.
    """
    captured = []

    def capture(module, args, kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        B, L, _ = x.shape
        q = module.q_proj(x).view(B, L, -1, module.head_dim).transpose(1, 2).float()
        k = module.k_proj(x).view(B, L, -1, module.head_dim).transpose(1, 2).float()
        captured.append(rotate(q, k, kwargs["position_embeddings"]))

    hooks = [layer.self_attn.register_forward_pre_hook(capture, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def fold_times(q: torch.Tensor, k: torch.Tensor, cfg: StillConfig) -> torch.Tensor:
    """When each token of a fresh pass leaves the softmax set [B, H_kv, L] (query i at time i;
    at least L for the tokens still visible to the last query), under `cfg`'s routing."""
    B, H, L, d = q.shape
    state = still.init_state(B, H, k.shape[1], 1, d, cfg.window, cfg.slots, device=q.device)
    valid = torch.ones(B, L, dtype=torch.bool, device=q.device)
    fold, _ = still.fresh_routing(q, k, k, valid, state, start=0, **cfg.op_options(d**-0.5))
    return fold


def classify(fold: torch.Tensor, positions: torch.Tensor, window: int) -> list[str]:
    """The fate of the tokens at `positions` (of a [L] fold-time row): visible to the last query,
    folded as it left the window (its chunk did not pick it, or the full slots held only better
    ones), or evicted from the salient slots later."""
    L = fold.shape[-1]
    times = fold[positions]
    return [VISIBLE if t >= L else LEFT_WINDOW if t == p + window else EVICTED
            for t, p in zip(times.tolist(), positions.tolist())]


def needle_positions(tokenizer, prompt: str, answer: str) -> list[torch.Tensor]:
    """Token indices of each occurrence of `answer` in `prompt` (as the model sees it, BOS included)."""
    encoded = tokenizer(prompt, return_offsets_mapping=True, add_special_tokens=True)
    offsets = encoded["offset_mapping"]
    found, start = [], prompt.find(answer)
    while start >= 0:
        end = start + len(answer)
        found.append(torch.tensor([i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]))
        start = prompt.find(answer, end)
    return found


def needle_routing(
    model: nn.Module,
    tokenizer,
    configs: Mapping[str, StillConfig],
    *,
    task: str = "passkey",
    lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    depths: Sequence[float] = (0, 25, 50, 75, 100),
    seed: int = 0,
    progress=None,
) -> dict:
    """For each config and length: the share of (prompt, layer, KV head) triples in which one whole
    copy of the needle is softmax-visible at the question (`reachable`, overall and per layer), and
    the fates of the needle's tokens (`tokens`: shares of visible / left_window / evicted).

    One forward per prompt (depth), its q and k routed under every config."""
    tally = {name: {n: {"reach": [], "fates": []} for n in lengths} for name in configs}
    for length, depth, copies, layers in _needle_prompts(model, tokenizer, task, lengths, depths, seed):
        for name, cfg in configs.items():
            reach, fates = [], []
            for q, k in layers:
                fold = fold_times(q, k, cfg)[0].cpu()
                per_head = [[classify(row, c, cfg.window) for c in copies] for row in fold]
                reach.append([float(any(all(f == VISIBLE for f in c) for c in head)) for head in per_head])
                fates += [f for head in per_head for c in head for f in c]
            tally[name][length]["reach"].append(reach)
            tally[name][length]["fates"] += fates
        if progress is not None:
            progress(length, depth)
    return {
        "task": task, "lengths": list(lengths), "depths": list(depths), "seed": seed,
        "configs": {name: vars(cfg) | {"per_chunk": cfg.per_chunk} for name, cfg in configs.items()},
        "results": {name: {str(n): _summary(cell) for n, cell in by_length.items()} for name, by_length in tally.items()},
    }


def _needle_prompts(model, tokenizer, task, lengths, depths, seed):
    """(length, depth, the needle's copies as token indices, every layer's rotated (q, k)) for the
    first sample of each of the evaluation's cells (`run_longcontext`'s seed), one forward each."""
    if task not in SINGLE_ANSWER_TASKS:
        raise ValueError(f"needle diagnostics take {' or '.join(SINGLE_ANSWER_TASKS)}, not {task!r}")
    device = next(model.parameters()).device
    variant = 1 if task == "niah_single" else None
    for length in lengths:
        for depth in depths:
            sample = build_sample(task, tokenizer, length, depth, sample_seed(seed, task, length, depth, 0, variant),
                                  variant=variant)
            ids = tokenizer(sample.prompt, return_tensors="pt").input_ids.to(device)
            yield length, depth, needle_positions(tokenizer, sample.prompt, sample.answers[0]), rotated_qk(model, ids)


def last_query_mass(q: torch.Tensor, k: torch.Tensor, attn: nn.Module) -> dict[str, torch.Tensor]:
    """The last query's normaliser split by source, per query head ([H, L] each) of a one-prompt pass
    (q [1, H, L, d], k [1, H_kv, L, d]): `softmax` holds e^{s_j - max} for the keys softmax-visible to it
    (the max over those), `linear` phi(q)^T phi(k_j) for the keys folded into the state. STILL layers
    route with their own config; a teacher's softmax attention sees every key with softmax."""
    H, L = q.shape[1], q.shape[2]
    n_rep = H // k.shape[1]
    keys = repeat_kv(k, n_rep)
    last = q[:, :, -1:]
    logits = (last @ keys.transpose(-1, -2))[0, :, 0] * attn.scaling
    if isinstance(attn, StillAttention):
        visible = fold_times(q, k, attn.cfg)[0].repeat_interleave(n_rep, dim=0) >= L
        linear = (attn.feature_map_q(last) @ attn.feature_map_k(keys).transpose(-1, -2))[0, :, 0] * ~visible
    elif isinstance(attn, LinearizedAttention):
        raise TypeError(f"needle mass reads STILL and softmax layers, not {type(attn).__name__}")
    else:
        visible, linear = torch.ones_like(logits, dtype=torch.bool), torch.zeros_like(logits)
    logits = logits.masked_fill(~visible, float("-inf"))
    softmax = (logits - logits.max(-1, keepdim=True).values).exp()
    return {"softmax": softmax, "linear": linear}


def needle_mass(
    model: nn.Module,
    tokenizer,
    *,
    task: str = "passkey",
    lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    depths: Sequence[float] = (0, 25, 50, 75, 100),
    seed: int = 0,
    eps: float = 1e-6,
    progress=None,
) -> dict:
    """How much of the question's attention can reach the needle, per length, from the last prompt
    token of each layer and query head (`last_query_mass`): the needle's softmax terms' share of the
    whole normaliser (`needle`), the share the linear state takes (`linear`), and the needle's share of
    the softmax terms alone (`needle_softmax_only`: what it would get without the linear terms).
    Averaged over prompts: per layer (`by_layer`) the best head's share for the needle, the mean
    head's for the linear state; for the model (`best`) the best layer's, or for the linear state
    the mean layer's. A teacher has no linear terms, so its `needle` is its own attention on it."""
    tally = {n: {"needle": [], "linear": [], "needle_softmax_only": []} for n in lengths}
    for length, depth, copies, layers in _needle_prompts(model, tokenizer, task, lengths, depths, seed):
        needle = torch.cat(copies)
        shares = {"needle": [], "linear": [], "needle_softmax_only": []}
        for (q, k), layer in zip(layers, model.model.layers):
            mass = last_query_mass(q, k, layer.self_attn)
            soft, lin = mass["softmax"], mass["linear"]
            total = soft.sum(-1) + lin.sum(-1) + eps
            shares["needle"].append((soft[:, needle].sum(-1) / total).max().item())
            shares["linear"].append((lin.sum(-1) / total).mean().item())
            shares["needle_softmax_only"].append((soft[:, needle].sum(-1) / (soft.sum(-1) + eps)).max().item())
        for name, values in shares.items():
            tally[length][name].append(values)
        if progress is not None:
            progress(length, depth)
    summary = {}
    for n, cell in tally.items():
        summary[str(n)] = {}
        for name, values in cell.items():
            per_layer = torch.tensor(values)  # [prompts, layers]
            best = per_layer.mean(dim=1) if name == "linear" else per_layer.max(dim=1).values
            summary[str(n)][name] = {"by_layer": per_layer.mean(dim=0).tolist(), "best": best.mean().item()}
    return {"task": task, "lengths": list(lengths), "depths": list(depths), "seed": seed, "results": summary}


def _summary(cell: dict) -> dict:
    reach = torch.tensor(cell["reach"])  # [prompts, layers, KV heads]
    fates = cell["fates"]
    return {
        "reachable": reach.mean().item(),
        "reachable_by_layer": reach.mean(dim=(0, 2)).tolist(),
        "tokens": {fate: fates.count(fate) / len(fates) for fate in (VISIBLE, LEFT_WINDOW, EVICTED)},
    }
