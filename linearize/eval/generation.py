"""Batched greedy generation with left padding, and the batch sizing shared by the eval loops."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from .. import decode
from ..decode import fully_linearized, greedy_decode, until_end

# Tokens (prompt + new) per generate call. Generation keeps only the last position's logits, so the
# KV cache bounds memory: 256K tokens of a 135M Llama are ~6 GB of cache.
DEFAULT_MAX_BATCH_TOKENS = 262144


def rows_per_batch(length: int, batch: int, max_batch_tokens: int) -> int:
    """`batch` rows, fewer for long sequences so one batch holds at most `max_batch_tokens` tokens."""
    return max(1, min(batch, max_batch_tokens // max(length, 1)))


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token lists right-aligned (left padding, as decoder-only generation expects)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def pad_token_id(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0


@torch.inference_mode()
def greedy_generate(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    *,
    batch: int = 8,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    desc: str = "generate",
    static: bool | None = None,
) -> list[str]:
    """Greedy continuations of `prompts` (decoded new tokens only), in input order.

    Prompts are sorted by length before batching so each batch carries little padding. A fully
    linearized model steps on its fixed-shape cache (`linearize.decode.greedy_decode`: a CUDA graph
    per step on a GPU, where HF's generate runs each step's hundreds of small ops eagerly); other
    models go through HF's generate, and so does a student with `static=False`.
    """
    if not prompts:
        return []
    if static is None:
        static = fully_linearized(model)
    encoded = tokenizer(list(prompts), add_special_tokens=True).input_ids  # one call: a fast tokenizer spreads it over cores
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    pad = pad_token_id(tokenizer)
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad,
        eos_token_id=eos,
    )
    outputs: list[str] = [""] * len(prompts)
    progress = tqdm(total=len(prompts), desc=desc, unit="prompt", leave=False)
    start = 0
    while start < len(order):
        longest = len(encoded[order[min(start + batch, len(order)) - 1]]) + max_new_tokens
        chunk = order[start : start + rows_per_batch(longest, batch, max_batch_tokens)]
        ids, mask = left_pad([encoded[i] for i in chunk], pad, model.device)
        if static:
            new = until_end(greedy_decode(model, ids, max_new_tokens, attention_mask=mask, eos_token_id=eos), eos)
        else:
            # HF prefills a long prompt in chunks too (`prefill_chunk_size`), so that its masks and
            # activations stay bounded as greedy_decode's do: a softmax sliding layer's mask over a
            # whole 128K prompt is 16 GiB a row, over a 16K chunk and its window 0.3 GiB.
            per_call = max(1, decode.PREFILL_TOKENS // len(chunk))
            config.prefill_chunk_size = per_call if ids.shape[1] > per_call else None
            new = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        for i, text in zip(chunk, texts):
            outputs[i] = text
        progress.update(len(chunk))
        start += len(chunk)
    progress.close()
    return outputs
