"""Log-probabilities of chosen tokens under the model's raw distribution (log_softmax of the logits, before
temperature and top-p), with the most likely alternatives, for the requests that ask for them.

The engine's thread computes them (`token_logprobs`) and hands them on with each token; the web layer
spells them out as OpenAI's bodies (`linearize.serve.logprob_bodies`).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One chosen token's log-probability and the `top` most likely tokens' (id, log-probability), most
    likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """The log-probability of `targets[i]` under `logits[i]` ([n, vocab]) and each row's `top` most likely
    tokens, in one read from the device."""
    if not targets:
        return []
    logprobs = torch.log_softmax(logits[:len(targets)].float(), dim=-1)
    ids = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
    k = min(top, logprobs.shape[-1])
    best, best_ids = logprobs.topk(k, dim=-1)
    # One read: each row's chosen log-probability, then its k best, then their ids (exact in float64).
    rows = torch.cat([logprobs.gather(1, ids).double(), best.double(), best_ids.double()], dim=1).cpu().tolist()
    return [TokenLogprob(token, row[0], tuple((int(i), v) for i, v in zip(row[1 + k:], row[1:1 + k])))
            for token, row in zip(targets, rows)]
