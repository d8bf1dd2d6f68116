"""The serving engine: one scheduler thread owns the model; each running request holds one row of state.

Each scheduler turn

1. admits waiting requests, in order, while fewer than `max_batch` run (and, for a softmax model, while
   their KV cache fits the memory budget), prefilling a new prompt alone, one chunk of tokens per turn,
   so that long prompts interleave with the running requests' steps: `prefill_chunk` tokens, or with
   `prefill_budget` > 0 and requests decoding, as many as take about `prefill_budget` times the last
   decode step's time (by the fitted cost of a call, `pacing.PrefillCost`; never fewer than its fixed
   share is worth), so that a turn with a prefill takes about 1 + `prefill_budget` steps and the gaps
   between a request's tokens stay even (in slots mode on a GPU, through one fixed-shape cache in
   chunks replayed from CUDA graphs, `linearize.prefill`, so that a small chunk costs its tokens and
   not an eager forward's launches);
2. copies a finished prefill's state into its row;
3. steps every row once, in one forward of the batch, and hands each running request its next token.

A finished, cancelled or failed request frees its row on the next turn. How the rows are held depends
on the model (`Engine.mode`):

- "slots", a fully linearized model: its decode state has one fixed shape per request, so the batch is
  a fixed set of slots (`max_batch` rows of one frozen cache) stepped together by `StaticDecoder` (a
  CUDA graph per step on a GPU; `StaticDecoder.load_row`). Idle slots step too, on whatever they hold:
  the step's shape never changes, and their tokens are dropped.
- "kv", a model with no linearized layers (a softmax teacher of any supported family): the rows are a
  `BatchedKVCache` (`linearize.serve.kv_slots`), per-layer key/value buffers [rows, KV heads, capacity,
  head dim] with a length per row, stepped together with per-row positions and masks. The running
  requests hold rows 0..n-1 (the last row's request moves into the row of one that leaves), and only
  those step.
  A request's keys and values grow with every token, so admission counts memory: a request waits
  until the buffers that all admitted requests can reach, rows x the longest prompt + `max_tokens` of
  them, plus the prefill in progress, fit `kv_budget_bytes`; one that could never fit alone fails at once.
- "serial", a hybrid (linearized and softmax layers): each request on its own cache, one step per
  running request a turn, with no batching across requests.

The web layer (`linearize.serve.app`) talks to the engine from its event loop: `submit` queues a
request (or raises `QueueFull`), `Request.tokens()` yields its token ids as the thread makes them,
`Request.cancel()` frees it, `Engine.stop()` drains.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import AsyncIterator

import torch
from transformers import DynamicCache

from ..attention import LinearizedAttention
from ..cache import compact_softmax_layers
from ..decode import StaticDecoder, fully_linearized
from ..prefill import StaticPrefill, largest_size, power_of_two_sizes
from . import kv_slots
from .kv_slots import BatchedKVCache
from .pacing import PrefillCost

# The default KV budget on a GPU: this share of the memory free when the engine starts, less the room a
# step's attention works in (`kv_slots.step_bytes_per_token`).
KV_MEMORY_SHARE = 0.9
# The fewest prompt tokens a turn prefills while requests decode: however short the decode step, every
# prompt still advances.
MIN_PREFILL_CHUNK = 16


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


_DONE = object()


class Request:
    """One submitted prompt: its generated token ids arrive through `tokens()`."""

    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop):
        self.id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.generated: list[int] = []
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
    def _emit(self, token: int) -> None:
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
class _Active:
    """A request the scheduler works on: prefilling (its own cache, or none through the engine's fixed-shape
    prefill; `done` prompt tokens in) or in a row."""

    request: Request
    cache: DynamicCache | None
    done: int = 0
    slot: int | None = None
    last: int | None = None  # the token the next step feeds


def _reach(request: Request) -> int:
    """The most positions a request's keys and values can take: its prompt and every token it may ask for."""
    return request.prompt_tokens + request.params.max_tokens


class Engine:
    """The scheduler thread and its rows (see the module's docstring). From `start` to `stop` the model
    is the thread's alone: its attention layers keep per-call state, so no other thread may run it.

    `kv_budget_bytes` (kv mode only): the most bytes of keys and values the admitted requests may reach;
    None: on a GPU, 90% of the memory free when the engine starts, less a step's working room; on a CPU,
    no limit.

    `static_prefill` (slots mode only): prefill the prompts through one fixed-shape cache in chunks of
    power-of-two sizes up to `prefill_chunk`, each replayed from a CUDA graph (`linearize.prefill`), so
    that a small paced chunk costs its tokens and not an eager forward's launches. None: on where it pays,
    with `prefill_budget` > 0 and the decode steps replayed from graphs (on a GPU)."""

    def __init__(self, model, *, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 2048,
                 prefill_budget: float = 0.0, eos_token_ids: tuple[int, ...] = (), cuda_graph: bool | None = None,
                 kv_budget_bytes: int | None = None, static_prefill: bool | None = None):
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1, max_queue >= 0")
        if not (math.isfinite(prefill_budget) and prefill_budget >= 0):
            raise ValueError(f"prefill_budget must be a finite number >= 0 (0: whole chunks), got {prefill_budget}")
        if kv_budget_bytes is not None and kv_budget_bytes < 1:
            raise ValueError(f"kv_budget_bytes must be >= 1, got {kv_budget_bytes}")
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
        # Why a softmax-only model is served serially after all (an attention implementation without masks
        # the batched cache can build); None otherwise.
        self.kv_unsupported = kv_slots.unsupported_reason(model) if softmax_only else None
        self._mode = "slots" if self.slotted else "kv" if softmax_only and self.kv_unsupported is None else "serial"
        self._kv = BatchedKVCache(model) if self._mode == "kv" else None
        self.kv_bytes_per_token = kv_slots.kv_bytes_per_token(model.config, parameter.dtype)
        self._kv_step_bytes_per_token = kv_slots.step_bytes_per_token(model.config, parameter.dtype)
        self.kv_budget_bytes = kv_budget_bytes
        self.peak_running = 0  # the most requests that generated at once
        self.prefill_calls = self.prefilled_tokens = 0  # how the prompts went in: calls, and tokens in all
        self._ids = itertools.count(1)
        self._waiting: collections.deque[Request] = collections.deque()
        self._prefilling: list[_Active] = []
        self._running: list[_Active] = []
        self._free_slots = list(range(max_batch)) if self.slotted else []
        self._decoder: StaticDecoder | None = None
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
        """"slots" (fully linearized), "kv" (no linearized layers) or "serial" (a hybrid)."""
        return self._mode

    def stats(self) -> dict:
        with self._wake:
            stats = {"running": len(self._running) + len(self._prefilling), "waiting": len(self._waiting),
                     "slots": self.max_batch, "mode": self.mode}
            if self._kv is not None:
                stats.update(kv_bytes=self._kv.nbytes, kv_budget_bytes=self.kv_budget_bytes)
            if self.prefill_path is not None:
                stats["prefill"] = self.prefill_path
            return stats

    def start(self) -> None:
        if self._kv is not None and self.kv_budget_bytes is None and self.device.type == "cuda":
            self.kv_budget_bytes = self._default_kv_budget()
        if self.static_prefill and self._prefill is None and self._thread is None:
            # Before any request, in this thread: the decoder first (it fuses the projections the prefill's
            # graphs then read), then every chunk size's graphs, so that no turn waits for a capture.
            with torch.inference_mode():
                self._slot_decoder()
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
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        request = Request(next(self._ids), prompt_ids, params, asyncio.get_running_loop())
        if self._kv is not None and self.kv_budget_bytes is not None and self._alone_too_big(request):
            raise TooLarge(self._too_big(request))
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

    def stop(self, drain: bool = True) -> None:
        """Take no new requests; with `drain` let the running and waiting ones finish, else cancel them;
        then end the thread."""
        with self._wake:
            self._accepting = False
            if not drain:
                for request in [*self._waiting, *(a.request for a in self._prefilling + self._running)]:
                    request.cancel()
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._prefill = None  # its graphs read the projections that closing the decoder unfuses
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None
        if self._kv is not None:
            self._kv.free()

    def _default_kv_budget(self) -> int:
        """KV_MEMORY_SHARE of the memory this process can still take on the device (free, and what torch
        holds cached unused), of which a step's attention keeps its working room."""
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        per_token = self.kv_bytes_per_token
        return max(1, int(KV_MEMORY_SHARE * free * per_token / (per_token + self._kv_step_bytes_per_token)))

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
        if self._kv is not None and self.kv_budget_bytes is not None:  # queued before the budget was known
            for request in [r for r in self._waiting if self._alone_too_big(r)]:
                self._waiting.remove(request)
                request._finish("error", self._too_big(request))
        while self._waiting and len(self._running) + len(self._prefilling) < self.max_batch:
            if self._kv is not None and not self._kv_fits(self._waiting[0]):
                break  # it waits for memory, and the ones behind it wait behind it
            request = self._waiting.popleft()
            # With the fixed-shape prefill every prompt goes through its one cache, so none of its own.
            cache = None if self._prefill is not None else DynamicCache(config=self.model.config)
            self._prefilling.append(_Active(request, cache))

    # Memory for the kv mode: the buffers hold rows x capacity positions, every row as long as the longest,
    # so the admitted requests can take rows x their longest reach; the prefill in progress holds its own
    # cache until it is copied into its row.

    def _kv_bytes(self, rows: int, reach: int, prefill: int) -> int:
        return (rows * reach + prefill) * self.kv_bytes_per_token

    def _kv_fits(self, request: Request) -> bool:
        if self.kv_budget_bytes is None:
            return True
        admitted = [a.request for a in self._running + self._prefilling]
        reach = max(_reach(r) for r in [*admitted, request])
        prefill = max(r.prompt_tokens for r in [*(a.request for a in self._prefilling), request])
        return self._kv_bytes(len(admitted) + 1, reach, prefill) <= self.kv_budget_bytes

    def _kv_limits(self) -> tuple[int, int]:
        """The rows and capacity the admitted requests can reach: what the buffers may grow to."""
        admitted = self._running + self._prefilling
        return len(admitted), max((_reach(a.request) for a in admitted), default=0)

    def _alone_too_big(self, request: Request) -> bool:
        return self._kv_bytes(1, _reach(request), request.prompt_tokens) > self.kv_budget_bytes

    def _too_big(self, request: Request) -> str:
        need = self._kv_bytes(1, _reach(request), request.prompt_tokens)
        return (f"the request's KV cache ({request.prompt_tokens} prompt tokens + max_tokens "
                f"{request.params.max_tokens}, and its prefill) would take {need / 2**20:.1f} MiB, more than the "
                f"engine's KV budget of {self.kv_budget_bytes / 2**20:.1f} MiB on its own: ask for fewer tokens")

    def _turn(self) -> None:
        self._drop_cancelled()
        if self._prefilling:
            active = self._prefilling[0]
            if self._kv is not None and active.done == 0:
                self._kv_make_room(active)
            self._prefill_chunk(active, self.prefill_tokens())
        if self._running:
            started = time.perf_counter()
            if self.slotted:
                self._step_slots()
            elif self._kv is not None:
                self._step_kv()
            else:
                for active in list(self._running):
                    self._step_alone(active)
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

    def _prefill_chunk(self, active: _Active, tokens: int) -> None:
        prompt = active.request.prompt_ids
        started = time.perf_counter()
        if self._prefill is not None:
            # The fixed cache holds the prompt at the head of the prefills until its row takes it.
            if active.done == 0:
                self._prefill.reset()
            end = active.done + largest_size(self._prefill.sizes, min(tokens, len(prompt) - active.done))
            logits = self._prefill.run(prompt[active.done:end])
        else:
            end = min(len(prompt), active.done + tokens)
            ids = torch.tensor([prompt[active.done:end]], device=self.device)
            logits = self.model(input_ids=ids, past_key_values=active.cache, use_cache=True, logits_to_keep=1).logits
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the chunk's own time, not a queue the next step waits on
        self.prefill_cost.add(end - active.done, time.perf_counter() - started)
        self.prefill_calls += 1
        self.prefilled_tokens += end - active.done
        active.done = end
        if end < len(prompt):
            return
        if active.cache is not None:
            compact_softmax_layers(active.cache)  # what a serial request decodes on from here
        limits = self._kv_limits()  # this request's row among them
        self._prefilling.remove(active)
        if not self._take(active, logits[0, -1]):
            return
        try:
            if self.slotted:
                decoder = self._slot_decoder()
                slot = self._free_slots.pop(0)  # back with all the others in `_fail_active` if the load fails
                decoder.load_row(slot, self._prefill.cache if self._prefill is not None else active.cache, len(prompt))
                active.slot = slot
            elif self._kv is not None:
                row = len(self._running)  # the running requests hold rows 0..n-1
                self._kv.set_limits(*limits)
                self._kv.load_row(row, active.cache, len(prompt))
                active.slot = row
        except Exception as e:  # it has left the prefills: fail it here, the others in `_fail_active`
            self._release(active, "error", _describe(e))
            raise
        if active.slot is not None:
            active.cache = None  # the row holds the state now
        self._running.append(active)
        self.peak_running = max(self.peak_running, len(self._running))

    def _slot_decoder(self) -> StaticDecoder:
        """The decoder over `max_batch` slots, made at the first admission from a one-token prefill of
        every row (their states are replaced as requests take the slots)."""
        if self._decoder is None:
            cache = DynamicCache(config=self.model.config)
            start = torch.zeros(self.max_batch, 1, dtype=torch.long, device=self.device)
            self.model(input_ids=start, past_key_values=cache, use_cache=True, logits_to_keep=1)
            self._decoder = StaticDecoder(self.model, cache, batch=self.max_batch, cuda_graph=self.cuda_graph)
        return self._decoder

    def _step_slots(self) -> None:
        tokens = [0] * self.max_batch
        for active in self._running:
            tokens[active.slot] = active.last
        # One upload of the step's tokens and one read of every row's argmax: per-row reads would
        # synchronise with the device once per running request.
        logits = self._decoder.step(torch.tensor(tokens, device=self.device).view(-1, 1))[:, -1]
        greedy = logits.argmax(-1).tolist()
        for active in list(self._running):
            self._take(active, logits[active.slot], greedy[active.slot])

    def _kv_make_room(self, active: _Active) -> None:
        """Before a prefill starts: shrink buffers left larger than the admitted requests need (by requests
        gone since), if with them the prefill's cache would pass the budget."""
        if self.kv_budget_bytes is None:
            return
        if self._kv.nbytes + self._kv_bytes(0, 0, active.request.prompt_tokens) > self.kv_budget_bytes:
            self._kv.set_limits(*self._kv_limits())
            self._kv.fit()

    def _step_kv(self) -> None:
        # The rows of this step, read before any request leaves: a leaving request hands its row to the last one.
        rows = [(active, active.slot) for active in self._running]
        tokens = [0] * len(rows)
        for active, row in rows:
            tokens[row] = active.last
        self._kv.set_limits(*self._kv_limits())
        logits = self._kv.step(self.model, torch.tensor(tokens, device=self.device).view(-1, 1))[:, -1]
        greedy = logits.argmax(-1).tolist()  # one read of every row's argmax
        for active, row in rows:
            self._take(active, logits[row], greedy[row])

    def _free_row(self, row: int) -> None:
        """A running request left row `row` (and `_running`): the last row's request moves into it, so
        that the running requests keep rows 0..n-1."""
        last = len(self._running)
        if row != last:
            moved = next(a for a in self._running if a.slot == last)
            self._kv.move_row(last, row)
            moved.slot = row
        self._kv.clear_row(last)
        if not self._running:
            self._kv.free()

    def _step_alone(self, active: _Active) -> None:
        ids = torch.tensor([[active.last]], device=self.device)
        logits = self.model(input_ids=ids, past_key_values=active.cache, use_cache=True, logits_to_keep=1).logits
        self._take(active, logits[0, -1])

    def _take(self, active: _Active, logits: torch.Tensor, greedy: int | None = None) -> bool:
        """Choose and hand on the next token from `logits` [vocab] (`greedy`: their argmax, if read
        already); False once the request has ended (its place is released)."""
        request = active.request
        if greedy is not None and request.params.temperature <= 0:
            token = greedy
        else:
            token = _sample(logits, request.params, request.generator)
        if token in self.eos_token_ids and not request.params.ignore_eos:
            self._release(active, "stop")
            return False
        request._emit(token)
        if len(request.generated) >= request.params.max_tokens:
            self._release(active, "length")
            return False
        active.last = token
        return True

    def _release(self, active: _Active, reason: str, error: str | None = None) -> None:
        for group in (self._prefilling, self._running):
            if active in group:
                group.remove(active)
        if active.slot is not None:
            if self._kv is not None:
                self._free_row(active.slot)
            else:
                self._free_slots.append(active.slot)
            active.slot = None
        active.cache = None
        active.request._finish(reason, error)
        with self._wake:
            self._wake.notify()

    def _fail_active(self, error: str) -> None:
        if self._kv is not None:  # its state may be half-written (a failed step or reallocation): drop it all
            for active in self._running:
                active.slot = None
            self._kv.free()
        for active in list(self._prefilling) + list(self._running):
            self._release(active, "error", error)
        if self._decoder is not None:  # its state may be half-written: start the slots afresh
            self._decoder.close()
            self._decoder = None
            self._free_slots = list(range(self.max_batch))


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; else a draw from softmax(logits / T), restricted to the top-p mass."""
    if params.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p  # the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
