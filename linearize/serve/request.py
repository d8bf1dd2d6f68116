"""What the engine takes and gives back: a submitted prompt (`Request`), how to sample it
(`SamplingParams`), the refusals `Engine.submit` raises, and `Active`, a request the scheduler works on.

A `Request` crosses threads: the web layer's event loop reads its tokens (`tokens()`), the engine's
thread hands them on (`_emit`, `_finish`), through the loop's own queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator

import torch
from transformers import DynamicCache

from .logprobs import TokenLogprob


class QueueFull(RuntimeError):
    """Every slot is busy and the waiting queue is full: the caller should answer 429."""


class TooLarge(ValueError):
    """The request's KV cache could never fit the engine's memory budget, even alone: the caller should
    answer 400."""


class EngineStopped(RuntimeError):
    """The engine is draining or stopped and takes no new requests: the caller should answer 503."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # keep generating past the model's end-of-sequence tokens (benchmarks)
    # Log-probabilities to hand on (`logprobs.TokenLogprob`), with this many alternatives each; None: none.
    # `logprobs`: of each generated token; `prompt_logprobs`: of each prompt token after the first, which
    # keeps every prompt position's logits through the prefill (only for the requests that ask).
    logprobs: int | None = None
    prompt_logprobs: int | None = None


_DONE = object()


class Request:
    """One submitted prompt: its generated token ids arrive through `tokens()`. With `params.logprobs`,
    `logprobs[i]` is the i-th generated token's, there before that token arrives; with
    `params.prompt_logprobs`, `prompt_logprobs` holds the prompt tokens' (None for the first, which
    nothing predicts), complete before the first token arrives or the request ends."""

    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop):
        self.id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.generated: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] = []
        # Prompt tokens restored from the engine's prefix cache instead of prefilled (OpenAI's
        # `usage.prompt_tokens_details.cached_tokens`), known once its prefill has begun.
        self.cached_tokens = 0
        self.finish_reason: str | None = None  # "stop" (an end-of-sequence token), "length", "cancelled", "error"
        self.error: str | None = None
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        generator = None
        if params.temperature > 0:
            generator = torch.Generator()
            generator.manual_seed(params.seed if params.seed is not None else request_id)
        self.generator = generator

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def reach(self) -> int:
        """The most positions its keys and values can take: its prompt and every token it may ask for."""
        return self.prompt_tokens + self.params.max_tokens

    def cancel(self) -> None:
        """Stop generating (the client went away, or a stop string matched): the slot frees next turn."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def tokens(self) -> AsyncIterator[int]:
        """The generated token ids, as they come; ends when the request finishes. Raises RuntimeError
        if the engine failed on this request."""
        while True:
            item = await self._queue.get()
            if item is _DONE:
                if self.finish_reason == "error":
                    raise RuntimeError(self.error or "the engine failed on this request")
                return
            yield item

    # Called from the engine thread.
    def _emit(self, token: int, logprob: TokenLogprob | None = None) -> None:
        if logprob is not None:
            self.logprobs.append(logprob)
        self.generated.append(token)
        self._post(token)

    def _finish(self, reason: str, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error
            self._post(_DONE)

    def _post(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop that would read it has closed: no one is listening any more
            pass


@dataclasses.dataclass
class Active:
    """A request the scheduler works on: prefilling (its own cache, or none through the engine's fixed-shape
    prefill; `done` prompt tokens in) or in a row."""

    request: Request
    cache: DynamicCache | None
    done: int = 0
    slot: int | None = None
    last: int | None = None  # the token the next step feeds
    # Prompt tokens (whole blocks) that follow a prompt in the prefix cache: a prefill call ends there, so
    # that the state where the two part is kept (`prefix_cache`); 0: none.
    branch: int = 0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; else a draw from softmax(logits / T), restricted to the top-p mass."""
    if params.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p  # the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
