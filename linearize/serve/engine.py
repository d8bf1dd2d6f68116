"""The serving engine: one scheduler thread owns the model; each running request holds one row of state.

Each scheduler turn

1. admits waiting requests, in order, while fewer than `max_batch` run (and, for a model with softmax
   layers, while their KV cache fits the memory budget), prefilling a new prompt alone, one chunk of tokens per turn,
   so that long prompts interleave with the running requests' steps: `prefill_chunk` tokens, or with
   `prefill_budget` > 0 and requests decoding, as many as take about `prefill_budget` times the last
   decode step's time (by the fitted cost of a call, `pacing.PrefillCost`; never fewer than its fixed
   share is worth), so that a turn with a prefill takes about 1 + `prefill_budget` steps and the gaps
   between a request's tokens stay even (in slots mode on a GPU, through one fixed-shape cache in
   chunks replayed from CUDA graphs, `linearize.prefill`, so that a small chunk costs its tokens and
   not an eager forward's launches);
2. copies a finished prefill's state into its row;
3. steps every row once, in one forward of the batch, and hands each running request its next token.

A request that asks for log-probabilities gets them with each token (`logprobs.token_logprobs`, of the
logits before temperature and top-p); one that asks for its prompt's is prefilled on its own cache keeping
every position's logits, which no other request pays for. `max_tokens` 0 ends a request after its prefill.

A prompt's prefill keeps copies of its prefill cache at block boundaries in a prefix cache (`prefix_cache`),
in every mode: per layer a linearized state, a sliding layer's last window of keys and values, a full
layer's keys and values of the whole prefix. A later prompt that starts with a cached prefix restores it
(into its own prefill cache, or into the fixed-shape one of `static_prefill`) and prefills only the rest.
The prefill calls end at those boundaries: the last one a chunk reaches, the prompt's end rounded down
to a block, and where the prompt parts from a cached one.

A finished, cancelled or failed request frees its row on the next turn. How the rows are held depends
on the model (`Engine.mode`):

- "slots", a fully linearized model: its decode state has one fixed shape per request, so the batch is
  a fixed set of slots (`max_batch` rows of one frozen cache) stepped together by `StaticDecoder` (a
  CUDA graph per step on a GPU; `StaticDecoder.load_row`). Idle slots step too, on whatever they hold:
  the step's shape never changes, and their tokens are dropped.
- "kv", a model with no linearized layers (a softmax teacher of any supported family), and "hybrid", one
  with both linearized and softmax layers: the rows are a `BatchedKVCache` (`linearize.serve.kv_slots`),
  where each layer keeps its own kind of rows: a full-attention layer key/value buffers [rows, KV heads,
  capacity, head dim] with a length per row, a sliding-window layer a ring of its last `window`
  positions per row, a linearized layer its fixed-shape state per row. All are stepped together, in one
  forward, with per-row positions and masks. The running requests hold rows 0..n-1 (the last row's
  request moves into the row of one that leaves), and only those step.
  A request's keys and values grow with every token, so admission counts memory: a request waits
  until the buffers that all admitted requests can reach, rows x the longest prompt + `max_tokens` of
  them (up to the window, in a sliding layer; nothing for a linearized one), plus the prefill in
  progress, fit `kv_budget_bytes`; one that could never fit alone fails at once. The prefix cache's
  snapshots are not counted there: they have their own budget, `prefix_cache_bytes` (and
  `prefix_cache_host_bytes` of host memory).

This module is the scheduler alone. Each mode's rows are a policy object of the same few methods
(`load` a finished prefill into a row, `step` the running rows, `free` a row, `abandon` them all after a
failure, `close`): `state_slots.StateSlots` and `kv_rows.KVRows`; the batched KV rows' admission by
memory is `kv_budget.KVBudget`. The requests and the refusals are in `request`.

The web layer (`linearize.serve.app`) talks to the engine from its event loop: `submit` queues a
request (or raises `QueueFull`), `Request.tokens()` yields its token ids as the thread makes them,
`Request.cancel()` frees it, `Engine.stop()` drains.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import threading
import time

import torch
from transformers import DynamicCache

from ..attention import LinearizedAttention
from ..decode import fully_linearized
from ..prefill import StaticPrefill, largest_size, power_of_two_sizes
from . import kv_slots
from .kv_budget import KV_MEMORY_SHARE, KVBudget, admitted_limits
from .kv_rows import KVRows
from .logprobs import token_logprobs
from .pacing import PrefillCost
from .prefix_cache import (
    DEFAULT_BLOCK,
    DEFAULT_BUDGET_BYTES,
    PrefixCache,
    restore_into_layers,
    restored_cache,
    take_snapshot,
)
from .request import Active, EngineStopped, QueueFull, Request, SamplingParams, TooLarge, sample
from .state_slots import StateSlots

# The engine's interface, importable from here as from `request`.
__all__ = ["KV_MEMORY_SHARE", "MIN_PREFILL_CHUNK", "Engine", "EngineStopped", "QueueFull", "Request",
           "SamplingParams", "TooLarge"]

# The fewest prompt tokens a turn prefills while requests decode: however short the decode step, every
# prompt still advances.
MIN_PREFILL_CHUNK = 16


class Engine:
    """The scheduler thread and its rows (see the module's docstring). From `start` to `stop` the model
    is the thread's alone: its attention layers keep per-call state, so no other thread may run it.

    `kv_budget_bytes` (kv and hybrid modes): the most bytes of keys and values the admitted requests may reach;
    None: on a GPU, 90% of the memory free when the engine starts less the prefix cache's budget, less a
    step's working room; on a CPU, no limit.

    `static_prefill` (slots mode only): prefill the prompts through one fixed-shape cache in chunks of
    power-of-two sizes up to `prefill_chunk`, each replayed from a CUDA graph (`linearize.prefill`), so
    that a small paced chunk costs its tokens and not an eager forward's launches. None: on where it pays,
    with `prefill_budget` > 0 and the decode steps replayed from graphs (on a GPU).

    `prefix_cache`: keep prefilled caches at every `prefix_block` tokens of the prompts, within
    `prefix_cache_bytes` on the model's device (None: 1 GiB on a GPU, 256 MiB on a CPU; apart from
    `kv_budget_bytes`), those it pushes out within `prefix_cache_host_bytes` of host memory (0: none), and
    start a prompt from its longest cached prefix (`prefix_cache.PrefixCache`)."""

    def __init__(self, model, *, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 2048,
                 prefill_budget: float = 0.0, eos_token_ids: tuple[int, ...] = (), cuda_graph: bool | None = None,
                 kv_budget_bytes: int | None = None, static_prefill: bool | None = None, prefix_cache: bool = True,
                 prefix_block: int = DEFAULT_BLOCK, prefix_cache_bytes: int | None = None,
                 prefix_cache_host_bytes: int = 0):
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1, max_queue >= 0")
        if not (math.isfinite(prefill_budget) and prefill_budget >= 0):
            raise ValueError(f"prefill_budget must be a finite number >= 0 (0: whole chunks), got {prefill_budget}")
        self.model = model.eval()
        parameter = next(model.parameters())
        self.device = parameter.device
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.prefill_budget = prefill_budget
        # The last decode step's seconds and what prefill calls cost: what sizes the next chunk while
        # requests decode (`prefill_tokens`).
        self._step_s: float | None = None
        self.prefill_cost = PrefillCost()
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.cuda_graph = cuda_graph
        self.slotted = fully_linearized(model)
        softmax_only = not any(isinstance(m, LinearizedAttention) for m in model.modules())
        self._mode = "slots" if self.slotted else "kv" if softmax_only else "hybrid"
        if not self.slotted and (reason := kv_slots.unsupported_reason(model)):
            raise ValueError(f"cannot serve this model: {reason}")
        self.kv_budget = KVBudget(model.config, parameter.dtype, kv_budget_bytes, kv_slots.layer_kinds(model))
        self._rows: StateSlots | KVRows
        if self._mode == "slots":
            self._rows = StateSlots(model, max_batch, cuda_graph)
        else:
            self._rows = KVRows(model, self.kv_budget)
        # The prefix cache, or why there is none.
        self.prefix_cache: PrefixCache | None = None
        self.prefix_cache_off = None if prefix_cache else "turned off"
        if prefix_cache:
            budget = prefix_cache_bytes or DEFAULT_BUDGET_BYTES["cuda" if self.device.type == "cuda" else "cpu"]
            self.prefix_cache = PrefixCache(prefix_block, budget, prefix_cache_host_bytes)
        self.peak_running = 0  # the most requests that generated at once
        self.prefill_calls = self.prefilled_tokens = 0  # how the prompts went in: calls, and tokens in all
        self._ids = itertools.count(1)
        self._waiting: collections.deque[Request] = collections.deque()
        self._prefilling: list[Active] = []
        self._running: list[Active] = []
        graphs = self.device.type == "cuda" and cuda_graph is not False
        if static_prefill is None:
            static_prefill = graphs and prefill_budget > 0
        self.static_prefill = static_prefill and self.slotted
        self._prefill: StaticPrefill | None = None  # made at `start`
        self.prefill_path: str | None = None  # how its chunks run (`StaticPrefill.path`), once made
        self._wake = threading.Condition()
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def mode(self) -> str:
        """"slots" (fully linearized), "kv" (no linearized layers) or "hybrid" (linearized and softmax layers)."""
        return self._mode

    @property
    def kv_budget_bytes(self) -> int | None:
        return self.kv_budget.limit

    @kv_budget_bytes.setter
    def kv_budget_bytes(self, limit: int | None) -> None:
        self.kv_budget.limit = limit

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_budget.bytes_per_token

    @property
    def _budgeted(self) -> bool:
        """Whether admission counts memory: batched KV rows, with a budget."""
        return self._kv_rows and self.kv_budget.limit is not None

    @property
    def _kv_rows(self) -> bool:
        """Whether the rows are a `BatchedKVCache`'s (kv and hybrid modes), whose keys and values grow."""
        return isinstance(self._rows, KVRows)

    def stats(self) -> dict:
        with self._wake:
            stats = {"running": len(self._running) + len(self._prefilling), "waiting": len(self._waiting),
                     "slots": self.max_batch, "mode": self.mode}
            if isinstance(self._rows, KVRows):
                stats.update(kv_bytes=self._rows.cache.nbytes, kv_budget_bytes=self.kv_budget_bytes)
            if self.prefill_path is not None:
                stats["prefill"] = self.prefill_path
            stats["prefix_cache"] = (self.prefix_cache.stats() if self.prefix_cache is not None else
                                     {"enabled": False, "why": self.prefix_cache_off})
            return stats

    def start(self) -> None:
        if self._kv_rows and self.kv_budget.limit is None and self.device.type == "cuda":
            set_aside = self.prefix_cache.budget_bytes if self.prefix_cache is not None else 0
            self.kv_budget.limit = self.kv_budget.default_for(self.device, set_aside)
        if self.static_prefill and self._prefill is None and self._thread is None:
            # Before any request, in this thread: the decoder first (it fuses the projections the prefill's
            # graphs then read), then every chunk size's graphs, so that no turn waits for a capture.
            with torch.inference_mode():
                self._rows.decoder()
                self._prefill = StaticPrefill(self.model, sizes=power_of_two_sizes(self.prefill_chunk),
                                              cuda_graph=self.cuda_graph)
                self._prefill.capture()
                self.prefill_path = self._prefill.path
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="linearize-engine", daemon=True)
            self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Queue a prompt (call from the event loop that will read its tokens)."""
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        if params.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0: the prompt's log-probabilities alone), got {params.max_tokens}")
        request = Request(next(self._ids), prompt_ids, params, asyncio.get_running_loop())
        if self._budgeted and (reason := self.kv_budget.too_big_alone(request)):
            raise TooLarge(reason)
        with self._wake:
            if not self._accepting:
                raise EngineStopped("the server is shutting down")
            # Capacity is the slots plus the queue, whether or not the thread has admitted the latest yet.
            held = len(self._running) + len(self._prefilling) + len(self._waiting)
            if held >= self.max_batch + self.max_queue:
                raise QueueFull(f"all {self.max_batch} slots are busy and {self.max_queue} requests wait already")
            self._waiting.append(request)
            self._wake.notify()
        return request

    def cancel_all(self) -> None:
        """Take no new requests and cancel every one held, without waiting: each ends "cancelled" at the
        thread's next turn."""
        with self._wake:
            self._accepting = False
            for request in [*self._waiting, *(a.request for a in self._prefilling + self._running)]:
                request.cancel()
            self._wake.notify()

    def stop(self, drain: bool = True) -> None:
        """Take no new requests; with `drain` let the running and waiting ones finish, else cancel them;
        then end the thread."""
        if not drain:
            self.cancel_all()
        with self._wake:
            self._accepting = False
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._prefill = None  # its graphs read the projections that closing the decoder unfuses
        self._rows.close()

    # The scheduler thread.

    def _loop(self) -> None:
        while True:
            with self._wake:
                self._admit()
                idle = not (self._prefilling or self._running or self._waiting)
                if idle and self._stopping:
                    return
                if idle:
                    self._wake.wait()
                    continue
            try:
                with torch.inference_mode():
                    self._turn()
            except Exception as e:  # noqa: BLE001 (a failed step fails its requests, not the server)
                self._fail_active(_describe(e))

    def _admit(self) -> None:
        """Waiting requests into free places, in order (under the lock); cancelled ones leave at once, and
        so do those whose KV cache could never fit the budget."""
        for request in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(request)
            request._finish("cancelled")
        if self._budgeted:  # queued before the budget was known
            for request in list(self._waiting):
                if reason := self.kv_budget.too_big_alone(request):
                    self._waiting.remove(request)
                    request._finish("error", reason)
        while self._waiting and len(self._running) + len(self._prefilling) < self.max_batch:
            if self._kv_rows and not self.kv_budget.fits(self._waiting[0], self._admitted(),
                                                              [a.request for a in self._prefilling]):
                break  # it waits for memory, and the ones behind it wait behind it
            request = self._waiting.popleft()
            # With the fixed-shape prefill every prompt goes through its one cache, so none of its own, but for
            # one that asks for its prompt's log-probabilities: that cache's graphs keep the last logits alone.
            own = self._prefill is None or request.params.prompt_logprobs is not None
            cache = DynamicCache(config=self.model.config) if own else None
            self._prefilling.append(Active(request, cache))

    def _admitted(self) -> list[Request]:
        return [a.request for a in self._running + self._prefilling]

    def _turn(self) -> None:
        self._drop_cancelled()
        if self._prefilling:
            active = self._prefilling[0]
            if isinstance(self._rows, KVRows) and active.done == 0:
                self._rows.make_room(active.request.prompt_tokens, admitted_limits(self._admitted()))
            self._prefill_chunk(active, self.prefill_tokens())
        if self._running:
            started = time.perf_counter()
            for active, logits, greedy in self._rows.step(self._running, admitted_limits(self._admitted())):
                self._take(active, logits, greedy)
            self._step_s = time.perf_counter() - started  # each step reads its tokens back: the device is done

    def prefill_tokens(self) -> int:
        """Prompt tokens the next prefill call takes: `prefill_chunk` while no request decodes (or with
        `prefill_budget` 0, or before a step and a chunk have been timed), else the chunk whose call takes
        about `prefill_budget` times the last decode step, by the fitted cost of a call (`PrefillCost`:
        fixed + per token; the last chunk's time per token until calls of two sizes are seen), but never
        fewer tokens than the fixed share's worth, below which a call would spend most of its time on
        what every call pays; within MIN_PREFILL_CHUNK..`prefill_chunk`."""
        cost = self.prefill_cost
        if not (self._running and self.prefill_budget and self._step_s and cost.last_per_token_s):
            return self.prefill_chunk
        budget_s = self.prefill_budget * self._step_s
        fit = cost.fit()
        if fit is None:
            tokens = budget_s / cost.last_per_token_s
        else:
            fixed_s, per_token_s = fit
            tokens = max((budget_s - fixed_s) / per_token_s, fixed_s / per_token_s)
        return max(min(MIN_PREFILL_CHUNK, self.prefill_chunk), min(self.prefill_chunk, int(tokens)))

    def _drop_cancelled(self) -> None:
        for group in (self._prefilling, self._running):
            for active in [a for a in group if a.request.cancelled]:
                self._release(active, "cancelled")

    def _prefill_chunk(self, active: Active, tokens: int) -> None:
        prompt = active.request.prompt_ids
        cached = self._caches_prefixes(active)
        if cached and active.done == 0:
            self._restore_prefix(active)
        started = time.perf_counter()
        scored = active.request.params.prompt_logprobs
        stop = self._prefill_stop(active, tokens) if cached else min(len(prompt), active.done + tokens)
        if active.cache is None:
            # The fixed cache holds the prompt at the head of the prefills until its row takes it.
            if active.done == 0:
                self._prefill.reset()
            end = active.done + largest_size(self._prefill.sizes, stop - active.done)
            logits = self._prefill.run(prompt[active.done:end])
        else:
            end = stop
            ids = torch.tensor([prompt[active.done:end]], device=self.device)
            keep = 0 if scored is not None else 1  # 0: every position's logits
            logits = self.model(input_ids=ids, past_key_values=active.cache, use_cache=True, logits_to_keep=keep).logits
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the chunk's own time, not a queue the next step waits on
        self.prefill_cost.add(end - active.done, time.perf_counter() - started)
        self.prefill_calls += 1
        self.prefilled_tokens += end - active.done
        if scored is not None:
            # Position i's logits score prompt token i + 1 (the last one's, the first generated token).
            if active.done == 0:
                active.request.prompt_logprobs.append(None)  # nothing scores the first token
            active.request.prompt_logprobs += token_logprobs(logits[0], prompt[active.done + 1:end + 1], scored)
        active.done = end
        if cached and end % self.prefix_cache.block == 0:
            self._keep_prefix(active)
        if end < len(prompt):
            return
        limits = admitted_limits(self._admitted())  # this request's row among them
        self._prefilling.remove(active)
        if active.request.params.max_tokens == 0:
            self._release(active, "length")
            return
        if not self._take(active, logits[0, -1]):
            return
        try:
            prefilled = self._prefill.cache if active.cache is None else active.cache
            active.slot = self._rows.load(prefilled, len(prompt), self._running, limits)
        except Exception as e:  # it has left the prefills: fail it here, the others in `_fail_active`
            self._release(active, "error", _describe(e))
            raise
        if active.slot is not None:
            active.cache = None  # the row holds the state now
        self._running.append(active)
        self.peak_running = max(self.peak_running, len(self._running))

    def _caches_prefixes(self, active: Active) -> bool:
        """Whether this request's prefill reads and feeds the prefix cache: not one that asks for its prompt's
        log-probabilities, which needs every position's logits."""
        return self.prefix_cache is not None and active.request.params.prompt_logprobs is None

    def _restore_prefix(self, active: Active) -> None:
        """Start the prompt from its longest cached prefix, if any."""
        found = self.prefix_cache.lookup(active.request.prompt_ids)
        active.branch = found.followed
        if found.snapshot is None:
            return
        if active.cache is None:
            restore_into_layers(self._prefill.layers, found.snapshot)
        else:
            active.cache = restored_cache(self.model.config, found.snapshot)
        active.done = active.request.cached_tokens = found.snapshot.tokens

    def _prefill_stop(self, active: Active, tokens: int) -> int:
        """Where the next prefill call ends, at most `tokens` on: where the prompt parts from a cached one,
        else the last block boundary within reach (the prompt's end rounded down to a block, then the end)."""
        start, length = active.done, active.request.prompt_tokens
        end = min(length, start + tokens)
        if start < active.branch < end:
            return active.branch
        boundary = end // self.prefix_cache.block * self.prefix_cache.block
        return boundary if boundary > start else end

    def _keep_prefix(self, active: Active) -> None:
        """Keep a copy of the prefill cache, whose prompt tokens so far end on a block boundary."""
        prefix = active.request.prompt_ids[:active.done]
        if self.prefix_cache.holds(prefix):
            return
        cache = self._prefill.cache if active.cache is None else active.cache
        try:
            snapshot = take_snapshot(cache, active.done)
        except torch.OutOfMemoryError:  # no room for a copy: the request goes on without one
            return
        self.prefix_cache.insert(prefix, snapshot)

    def _take(self, active: Active, logits: torch.Tensor, greedy: int | None = None) -> bool:
        """Choose and hand on the next token from `logits` [vocab] (`greedy`: their argmax, if read
        already); False once the request has ended (its place is released)."""
        request = active.request
        if greedy is not None and request.params.temperature <= 0:
            token = greedy
        else:
            token = sample(logits, request.params, request.generator)
        if token in self.eos_token_ids and not request.params.ignore_eos:
            self._release(active, "stop")
            return False
        scored = request.params.logprobs
        request._emit(token, None if scored is None else token_logprobs(logits.view(1, -1), [token], scored)[0])
        if len(request.generated) >= request.params.max_tokens:
            self._release(active, "length")
            return False
        active.last = token
        return True

    def _release(self, active: Active, reason: str, error: str | None = None) -> None:
        for group in (self._prefilling, self._running):
            if active in group:
                group.remove(active)
        if active.slot is not None:
            self._rows.free(active.slot, self._running)
            active.slot = None
        active.cache = None
        active.request._finish(reason, error)
        with self._wake:
            self._wake.notify()

    def _fail_active(self, error: str) -> None:
        self._rows.abandon(self._running)  # their states may be half-written: no row is kept
        for active in list(self._prefilling) + list(self._running):
            self._release(active, "error", error)


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
