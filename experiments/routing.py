"""Where STILL's routing leaves a needle: softmax-visible at the question, or folded into the state.

A retrieval prompt is answered from the last prompt token. STILL can copy the needle's tokens from
there only in the (layer, KV head) pairs whose softmax set still holds them; a needle folded into the
linear state survives only as a blur. The routing is discrete and depends on q and k alone, so it is
replayed here from each layer's RoPE'd q and k (`linearize.ops.still.routing.fresh_routing`, the rule
training, prefill and decoding share) under any `StillConfig`, without training a model per routing variant.

Visible is not the same as attended to: `needle_mass` weighs, on a model as it is (STILL, Lizard with one shared
normaliser, or a softmax teacher), how much of the question's normaliser the needle gets, and how
much the linear terms take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from linearize.attention.base import LinearizedAttention, rotate
from linearize.attention.lizard import LizardAttention
from linearize.attention.still import StillAttention
from linearize.config import StillConfig
from linearize.eval.longcontext import build_sample, sample_seed
from linearize.eval.texts import essay_sentences
from linearize.ops.common import cumsum_over_tokens, exp_weights, repeat_kv
from linearize.ops.still import StillOptions
from linearize.ops.still import naive as still
from linearize.ops.still import routing as still_routing

VISIBLE, LEFT_WINDOW, EVICTED = "visible", "left_window", "evicted"
SINGLE_ANSWER_TASKS = ("passkey", "niah_single")  # one needle string (niah_single: any of its three variants)


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
    fold, _ = still_routing.fresh_routing(q, k, k, valid, state, StillOptions(**cfg.op_options(d**-0.5)), start=0)
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
    variant: int | None = None,
    essay: Sequence[str] = (),
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
    prompts = _needle_prompts(model, tokenizer, task, variant, essay, lengths, depths, seed)
    for length, depth, copies, layers in prompts:
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
        "task": task, "variant": _variant(task, variant), "lengths": list(lengths), "depths": list(depths), "seed": seed,
        "configs": {name: vars(cfg) | {"per_chunk": cfg.per_chunk} for name, cfg in configs.items()},
        "results": {name: {str(n): _summary(cell) for n, cell in by_length.items()} for name, by_length in tally.items()},
    }


def _variant(task: str, variant: int | None) -> int | None:
    """niah_single's variant (1 unless given: word keys and numbers in a noise haystack); None for passkey."""
    if task == "niah_single":
        return 1 if variant is None else variant
    if variant is not None:
        raise ValueError(f"only niah_single has variants, not {task!r}")
    return None


def _needle_prompts(model, tokenizer, task, variant, essay, lengths, depths, seed, capture=rotated_qk):
    """(length, depth, the needle's copies as token indices, `capture(model, ids)`: by default every
    layer's rotated (q, k)) for the first sample of each of the evaluation's cells (`run_longcontext`'s
    seed), one forward each. niah_single's variants 2 and 3 (numbers, UUIDs) hide the needle in essay
    sentences: `essay`, or the evaluation's default texts."""
    if task not in SINGLE_ANSWER_TASKS:
        raise ValueError(f"needle diagnostics take {' or '.join(SINGLE_ANSWER_TASKS)}, not {task!r}")
    variant = _variant(task, variant)
    if variant is not None and variant > 1 and not essay:
        essay = essay_sentences()
    device = next(model.parameters()).device
    for length in lengths:
        for depth in depths:
            sample = build_sample(task, tokenizer, length, depth, sample_seed(seed, task, length, depth, 0, variant),
                                  variant=variant, essay=essay)
            ids = tokenizer(sample.prompt, return_tensors="pt").input_ids.to(device)
            yield length, depth, needle_positions(tokenizer, sample.prompt, sample.answers[0]), capture(model, ids)


def attention_inputs(model: nn.Module, input_ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer, in one forward, what `last_query_mass` needs: the rotated q and k (`rotated_qk`) and,
    for Lizard layers, the branch inputs their own call computes (phi_q(q), phi_k(k) per query head,
    the window's q and k, log gamma: `fq`, `fk`, `qw`, `kw`, `log_g`, float32)."""
    captured = [{} for _ in model.model.layers]
    wrapped = ("branch_inputs", "log_gate")

    def recording(attn, slot, name, keys):
        def method(*args, **kwargs):
            out = getattr(type(attn), name)(attn, *args, **kwargs)
            slot.update(zip(keys, (t.float() for t in (out if isinstance(out, tuple) else (out,)))))
            return out
        return method

    for slot, layer in zip(captured, model.model.layers):
        attn = layer.self_attn
        if isinstance(attn, LizardAttention):
            # The instance's own, for this forward only: its call's results, not a second computation.
            attn.branch_inputs = recording(attn, slot, "branch_inputs", ("fq", "fk", "qw", "kw"))
            attn.log_gate = recording(attn, slot, "log_gate", ("log_g",))
    try:
        for slot, (q, k) in zip(captured, rotated_qk(model, input_ids)):
            slot.update(q=q, k=k)
    finally:
        for layer in model.model.layers:
            for name in wrapped:
                vars(layer.self_attn).pop(name, None)
    return captured


def last_query_mass(inputs: dict[str, torch.Tensor], attn: nn.Module) -> dict[str, torch.Tensor]:
    """The last query's shared normaliser split by source, per query head, from a one-prompt pass's
    `attention_inputs`: `softmax` [H, L] holds e^{s_j - m} for the keys softmax-visible to it, `linear`
    [H, L] its linear weight on each key, `sinks` [H] the sinks' e^{t - m} (m: the max over the softmax
    logits and sinks). Teacher layers see every key with softmax; STILL layers route with their own
    config (their output gate scales the linear numerator, not these weights); Lizard layers with one
    shared normaliser weigh every key linearly, decayed by the gates since it, and the window's with
    softmax."""
    lizard = isinstance(attn, LizardAttention)
    q, k = (inputs["qw"], inputs["kw"]) if lizard else (inputs["q"], inputs["k"])  # what softmax sees
    H, L = q.shape[1], q.shape[2]
    n_rep = H // k.shape[1]
    keys = repeat_kv(k, n_rep)
    sink_logits = None
    if lizard:
        if attn.cfg.combine != "shared":
            raise TypeError("needle mass reads Lizard with one shared normaliser (combine='shared'), not "
                            f"combine={attn.cfg.combine!r}: its two branches normalise apart")
        fq, fk, log_g = inputs["fq"], inputs["fk"], inputs["log_g"]
        # Token j's weight at the end has decayed by the gates after it (state_after's reverse cumsum).
        to_end = (cumsum_over_tokens(log_g, reverse=True) - log_g).exp()
        linear = (fq[:, :, -1:] * fk * to_end).sum(-1)[0]
        visible = torch.arange(L, device=q.device) >= L - attn.cfg.window
        if attn.cfg.num_sinks:
            sink_logits = attn.sinks.float()
    elif isinstance(attn, StillAttention):
        visible = fold_times(q, k, attn.cfg)[0].repeat_interleave(n_rep, dim=0) >= L
        linear = (attn.feature_map_q(q[:, :, -1:]) @ attn.feature_map_k(keys).transpose(-1, -2))[0, :, 0] * ~visible
    elif isinstance(attn, LinearizedAttention):
        raise TypeError(f"needle mass reads STILL, Lizard and softmax layers, not {type(attn).__name__}")
    else:
        visible, linear = torch.ones(L, dtype=torch.bool, device=q.device), torch.zeros(H, L, device=q.device)
    logits = (q[:, :, -1:] @ keys.transpose(-1, -2))[0, :, 0] * attn.scaling
    softmax, sinks = exp_weights(logits.masked_fill(~visible, float("-inf")), sink_logits)
    return {"softmax": softmax, "linear": linear,
            "sinks": torch.zeros(H, device=q.device) if sinks is None else sinks.sum(-1)}


# The shares `needle_mass` reports, as the reports and plots label them.
MASS_SHARES = {
    "needle": "key's share of the normaliser (best head)",
    "needle_linear": "key's linear terms' share (best head)",
    "linear": "linear terms' share (mean over heads)",
    "needle_softmax_only": "key's share of the softmax terms alone (best head)",
}


def needle_mass(
    model: nn.Module,
    tokenizer,
    *,
    task: str = "passkey",
    variant: int | None = None,
    essay: Sequence[str] = (),
    lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    depths: Sequence[float] = (0, 25, 50, 75, 100),
    seed: int = 0,
    eps: float = 1e-6,
    progress=None,
) -> dict:
    """How much of the question's attention reaches the needle, per length, from the last prompt token
    of each layer and query head (`last_query_mass`), as shares of the whole normaliser: the needle's
    terms, softmax and linear (`needle`: the weight it gets in the output), its linear terms alone
    (`needle_linear`), every key's linear terms (`linear`); and the needle's share of the softmax terms
    alone (`needle_softmax_only`: what it would get without the linear terms). Averaged over prompts:
    per layer (`by_layer`) the best head's share for the needle, the mean head's for `linear`; for the
    model (`best`) the best layer's, or the mean layer's for `linear`. A teacher has no linear terms,
    so its `needle` is its own attention on the needle."""
    tally = {n: {name: [] for name in MASS_SHARES} for n in lengths}
    prompts = _needle_prompts(model, tokenizer, task, variant, essay, lengths, depths, seed, capture=attention_inputs)
    for length, depth, copies, layers in prompts:
        needle = torch.cat(copies)
        shares = {name: [] for name in MASS_SHARES}
        for inputs, layer in zip(layers, model.model.layers):
            mass = last_query_mass(inputs, layer.self_attn)
            soft, lin = mass["softmax"], mass["linear"]
            total = soft.sum(-1) + lin.sum(-1) + mass["sinks"] + eps
            shares["needle"].append(((soft[:, needle] + lin[:, needle]).sum(-1) / total).max().item())
            shares["needle_linear"].append((lin[:, needle].sum(-1) / total).max().item())
            shares["linear"].append((lin.sum(-1) / total).mean().item())
            softmax_total = soft.sum(-1) + mass["sinks"] + eps
            shares["needle_softmax_only"].append((soft[:, needle].sum(-1) / softmax_total).max().item())
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
    return {"task": task, "variant": _variant(task, variant), "lengths": list(lengths), "depths": list(depths),
            "seed": seed, "results": summary}


def _summary(cell: dict) -> dict:
    reach = torch.tensor(cell["reach"])  # [prompts, layers, KV heads]
    fates = cell["fates"]
    return {
        "reachable": reach.mean().item(),
        "reachable_by_layer": reach.mean(dim=(0, 2)).tolist(),
        "tokens": {fate: fates.count(fate) / len(fates) for fate in (VISIBLE, LEFT_WINDOW, EVICTED)},
    }
