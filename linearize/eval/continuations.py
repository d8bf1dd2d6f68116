"""lm-eval's log-likelihood requests scored a batch at a time, with one copy to the host per batch.

lm-eval's HF wrapper scores each request on its own after the batch's forward: it slices its logits,
takes the argmax and gathers the continuation's log-probabilities, then reads both back with two
host synchronisations: at HellaSwag's 40,168 short requests, 80,336 waits for the GPU, each of which
on a GPU shared by several processes also waits for the others' work. Here every request of a
batch is scored by the same few tensor operations and the answers come back in one copy.

The answers are lm-eval's: the same left truncation to the model's length, requests whose inputs
are equal (a context with one-token continuations, as lm-eval's `logits_cache` groups them) share
one forward, the log-softmax runs in the logits' dtype (or `softmax_dtype`), "greedy" compares the
argmax of those log-probabilities, and the sum is rounded to that dtype as `Tensor.sum` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

Request = tuple[object, Sequence[int], Sequence[int]]  # (cache key, context tokens, continuation tokens)


def score_continuations(requests: list[Request], forward: Callable[[torch.Tensor], torch.Tensor], *,
                        max_length: int, rows_for: Callable[[int], int], device, softmax_dtype=None,
                        on_batch: Callable[[list[int], list[tuple[float, bool]]], None] | None = None,
                        ) -> list[tuple[float, bool]]:
    """[(log-probability of the continuation given its context, whether it is the greedy one)] in the
    requests' order. `forward(ids)` gives logits [rows, length, vocabulary]; a batch holds at most
    `rows_for(length of its longest input)` inputs, longest first; `on_batch(indices, answers)`
    hears each batch's requests as they are scored."""
    inputs: dict[tuple[int, ...], list[int]] = {}  # input tokens -> the requests scored on them
    for i, (_, context, continuation) in enumerate(requests):
        if not context or not continuation:
            raise ValueError(f"request {i} has an empty context or continuation")
        if len(continuation) > max_length:
            raise ValueError(f"request {i}: its {len(continuation)}-token continuation is longer than the "
                             f"model's {max_length} tokens")
        tokens = (list(context) + list(continuation))[-(max_length + 1):]
        inputs.setdefault(tuple(tokens[:-1]), []).append(i)
    order = sorted(inputs, key=lambda ids: (-len(ids), ids))
    answers: list[tuple[float, bool] | None] = [None] * len(requests)
    start = 0
    while start < len(order):
        batch = order[start:start + max(1, rows_for(len(order[start])))]
        start += len(batch)
        scored = [(row, i) for row, ids in enumerate(batch) for i in inputs[ids]]
        results = _score_batch(batch, [(row, requests[i][2]) for row, i in scored], forward, device, softmax_dtype)
        for (_, i), answer in zip(scored, results, strict=True):
            answers[i] = answer
        if on_batch is not None:
            on_batch([i for _, i in scored], results)
    return answers


def _score_batch(inputs: list[tuple[int, ...]], targets: list[tuple[int, Sequence[int]]], forward, device,
                 softmax_dtype) -> list[tuple[float, bool]]:
    """One forward over `inputs` (right-padded); each (row, continuation) in `targets` is scored on the
    last len(continuation) positions of its row."""
    width = len(inputs[0])
    ids = torch.zeros(len(inputs), width, dtype=torch.long)
    for row, tokens in enumerate(inputs):
        ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    rows, positions, tokens, owner = [], [], [], []
    for k, (row, continuation) in enumerate(targets):
        end = len(inputs[row])
        rows += [row] * len(continuation)
        positions += range(end - len(continuation), end)
        tokens += continuation
        owner += [k] * len(continuation)
    logits = forward(ids.to(device))
    picked = logits[torch.tensor(rows, device=logits.device), torch.tensor(positions, device=logits.device)]
    logprobs = F.log_softmax(picked, dim=-1, dtype=softmax_dtype)
    tokens = torch.tensor(tokens, device=logits.device)
    owner = torch.tensor(owner, device=logits.device)
    token_logprobs = logprobs.gather(1, tokens[:, None])[:, 0]
    sums = torch.zeros(len(targets), dtype=torch.float32, device=logits.device).index_add_(
        0, owner, token_logprobs.float()).to(logprobs.dtype)
    misses = torch.zeros(len(targets), dtype=torch.long, device=logits.device).index_add_(
        0, owner, (logprobs.argmax(-1) != tokens).long())
    both = torch.stack([sums.float(), (misses == 0).float()], dim=1).tolist()  # the batch's one copy
    return [(total, bool(greedy)) for total, greedy in both]
