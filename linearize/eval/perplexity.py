"""Task `ppl`: perplexity on held-out long text at several context lengths, and loss vs position.

The text's tokens are cut into non-overlapping windows of each length (the same leading
`max_tokens` tokens for every length, so lengths are compared on the same text). Each window is
scored on its own: loss over its tokens 2..L, predicted from the tokens before them in the window.
A tokenizer that starts every text with special ids (Gemma's <bos>) has them start every window,
as the model saw in training; the text then fills the other L - 1 positions.
The windows of the longest length also give the mean loss at each position, bucketed on a log scale:
a model that extrapolates keeps that curve flat or falling past its training length.
"""

from __future__ import annotations

import math
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from linearize.data.tokenize import text_prefix
from linearize.decode import PREFILL_TOKENS
from linearize.eval.generation import rows_per_batch

DEFAULT_MAX_TOKENS = 65536
DEFAULT_BUCKETS = 48
# Tokens whose logits exist at once (8192 x 49152 in float32: 1.6 GB), which bounds the loss's memory:
# the whole forward's logits, as `model(...).logits` gives them, take 6 GB for 65536 tokens, and a float32
# copy of all of a batch's rows at once (128 rows of 512) 13 GB more, too much beside other evaluations
# sharing the GPU.
LOSS_TOKENS = 8192
PPL_BATCH_TOKENS = 65536  # tokens per forward pass


def text_tokens(tokenizer, path: str | Path) -> torch.Tensor:
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False).input_ids, dtype=torch.long)


def decoder_hidden(model, ids: torch.Tensor, call_length: int) -> torch.Tensor:
    """The decoder's last hidden states [rows, L, d] for `ids` [rows, L], in calls of `call_length`
    positions when L is longer. Later calls continue the cache (softmax KV, linear states), which
    gives the one call's result; what one call builds stays bounded: a sliding-window layer's HF mask
    for one call over a 128K window is 16 GiB. Shorter windows keep the one cacheless call, the
    batches of `perplexity` bounding their tokens."""
    from transformers import DynamicCache

    decoder = model.get_decoder()
    if ids.shape[1] <= call_length:
        return decoder(input_ids=ids, use_cache=False).last_hidden_state
    cache = DynamicCache(config=model.config)
    parts = [decoder(input_ids=ids[:, start : start + call_length], past_key_values=cache, use_cache=True)
             .last_hidden_state for start in range(0, ids.shape[1], call_length)]
    return torch.cat(parts, 1)


@torch.inference_mode()
def token_nll(model, windows: torch.Tensor, call_length: int = PREFILL_TOKENS) -> torch.Tensor:
    """Per-token negative log-likelihood [rows, L - 1] of each window's tokens 2..L: the decoder's
    hidden states once (`decoder_hidden`), the output head over LOSS_TOKENS of them at a time."""
    ids = windows.to(model.device)
    hidden = decoder_hidden(model, ids, call_length)[:, :-1]
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), ids[:, 1:].reshape(-1)
    head = model.get_output_embeddings()
    losses = [F.cross_entropy(head(hidden[start : start + LOSS_TOKENS]).float(), targets[start : start + LOSS_TOKENS],
                              reduction="none") for start in range(0, len(targets), LOSS_TOKENS)]
    return torch.cat(losses).view(ids.shape[0], -1).cpu()


def log_buckets(length: int, count: int) -> list[tuple[int, int]]:
    """Up to `count` [start, end) ranges of target positions 1..length-1, log-spaced, none empty."""
    edges = sorted({round(math.exp(math.log(length) * i / count)) for i in range(count + 1)} | {1, length})
    return list(pairwise(edges))


def perplexity(
    model,
    tokenizer,
    lengths: list[int],
    *,
    text: str | Path | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    limit: int | None = None,
    batch: int = 8,
    max_batch_tokens: int = PPL_BATCH_TOKENS,
    buckets: int = DEFAULT_BUCKETS,
) -> dict:
    """Perplexity per context length and the loss-by-position curve at the longest length.

    `text` defaults to Moby-Dick from the public-domain texts; `limit` caps windows per length.
    """
    if text is None:
        from linearize.eval.texts import default_ppl_text

        text = default_ppl_text()
    tokens = text_tokens(tokenizer, text)
    prefix = torch.tensor(text_prefix(tokenizer), dtype=torch.long)
    longest = max(lengths)
    budget = min(len(tokens), max(max_tokens, longest))
    if budget < longest - len(prefix):
        raise ValueError(f"{text} has {len(tokens)} tokens, fewer than the context length {longest}.")

    by_length = []
    position_sum = torch.zeros(longest - 1, dtype=torch.float64)
    for length in sorted(lengths):
        body = length - len(prefix)
        count = budget // body if limit is None else min(budget // body, limit)
        windows = torch.cat([prefix.expand(count, -1), tokens[: count * body].view(count, body)], 1)
        step = rows_per_batch(length, batch, max_batch_tokens)
        total = 0.0
        for start in tqdm(range(0, count, step), desc=f"ppl@{length}", leave=False):
            nll = token_nll(model, windows[start : start + step]).double()
            total += nll.sum().item()
            if length == longest:
                position_sum += nll.sum(dim=0)
        mean = total / (count * (length - 1))
        by_length.append({"length": length, "ppl": math.exp(mean), "nll": mean, "windows": count})

    windows_at_longest = by_length[-1]["windows"]
    curve = [
        {"start": lo, "end": hi, "loss": position_sum[lo - 1 : hi - 1].mean().item() / windows_at_longest}
        for lo, hi in log_buckets(longest, buckets)
    ]
    return {
        "text": str(text),
        "text_tokens": len(tokens),
        "max_tokens": budget,
        "by_length": by_length,
        "loss_by_position": {"length": longest, "windows": windows_at_longest, "buckets": curve},
    }
