"""One optimizer step (forward and backward over the micro-batches, clipping, the optimizer), eager or
replayed from a CUDA graph.

A training step at a fixed shape is a few thousand small launches; `bench train`'s profiles show the
host issuing them slower than the GPU runs them (stage 2 of the best Lizard: 237 ms of host time
against 107 ms of GPU time a step). Captured once as a CUDA graph, the step replays them back to back.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

# Eager steps before the capture: kernels compile, autograd and cuBLAS set up their state, and the
# optimizer's moments exist, so that the capture records steady-state work only.
WARMUP_STEPS = 3

# A micro-batch: token ids, or a tuple of tensors that the loss takes together (ids and what a teacher
# computed on them once, say). A graph holds a copy of each tensor and replays on new values.
MicroBatch = torch.Tensor | tuple[torch.Tensor, ...]


def _tensors(batch: MicroBatch) -> tuple[torch.Tensor, ...]:
    return batch if isinstance(batch, tuple) else (batch,)


def _shapes(batches: list[MicroBatch]) -> list[torch.Size]:
    return [t.shape for batch in batches for t in _tensors(batch)]


def _cloned(batch: MicroBatch) -> MicroBatch:
    return tuple(t.clone() for t in batch) if isinstance(batch, tuple) else batch.clone()


def graphable_optimizer(groups: list[dict], device: torch.device, **options) -> torch.optim.AdamW:
    """AdamW whose step a CUDA graph can hold: `capturable` keeps its step counts on the device, and
    each group's learning rate is a device tensor that a scheduler fills in place, so a replayed step
    reads the current rate instead of the one baked in at capture."""
    groups = [dict(g, lr=torch.tensor(float(g.get("lr", 1e-3)), device=device)) for g in groups]
    return torch.optim.AdamW(groups, capturable=True, **options)


def make_optimizer(groups: list[dict], device: torch.device, *, cuda_graph: bool, **options) -> torch.optim.AdamW:
    """The AdamW a TrainStep steps: `graphable_optimizer`'s where that step will be captured
    (`cuda_graph` on a CUDA device), else the plain one."""
    if cuda_graph and device.type == "cuda":
        return graphable_optimizer(groups, device, **options)
    return torch.optim.AdamW(groups, **options)


def rates_on_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """After `load_state_dict`, which may bring plain-float rates back from an eager run's checkpoint."""
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), device=device)


class TrainStep:
    """`step(micro_batches)` -> (mean loss, gradient norm), both device tensors (read them when logging).

    `loss_fn(batch)` gives one micro-batch's loss (`MicroBatch`); `autocast(cache_enabled)` its precision
    context.
    `before_clip` runs between the backward passes and clipping (the hand-averaged gradients of data
    parallelism; its all-reduce is captured with the rest). With `cuda_graph` (CUDA only, and an
    optimizer from `graphable_optimizer`), the first WARMUP_STEPS steps run eagerly on a side stream,
    the next is captured and every later one replays the graph on copies of its micro-batches.
    `uncapturable`, the caller's reason why a graph cannot hold this step, keeps it eager and is what
    `path` says. A capture that fails (an op that reads back from the device, say) leaves the step
    eager, and `path` says why.
    """

    def __init__(self, loss_fn: Callable[[MicroBatch], torch.Tensor], params: list[torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer, clip: float,
                 autocast: Callable[[bool], AbstractContextManager], *, cuda_graph: bool = False,
                 before_clip: Callable[[], None] | None = None, uncapturable: str | None = None):
        self.loss_fn, self.params, self.optimizer, self.clip = loss_fn, params, optimizer, clip
        self.autocast, self.before_clip = autocast, before_clip
        self.graphed = cuda_graph and uncapturable is None and all(p.is_cuda for p in params)
        self.reason = None if self.graphed or not cuda_graph else uncapturable or "parameters not on a CUDA device"
        self.steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[MicroBatch] = []
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stream = torch.cuda.Stream() if self.graphed else None

    @property
    def path(self) -> str:
        if self.graph is not None:
            return "cuda graph"
        return f"eager ({self.reason})" if self.reason else "eager"

    def __call__(self, micro_batches: list[MicroBatch]) -> tuple[torch.Tensor, torch.Tensor]:
        self.steps += 1
        if self.graph is not None and _shapes(micro_batches) == _shapes(self.inputs):
            return self._replay(micro_batches)
        if self.graphed and self.graph is None and self.steps > WARMUP_STEPS and self._capture(micro_batches):
            return self._replay(micro_batches)
        if not self.graphed:
            return self._eager(micro_batches)
        # Warm-up (and any step whose shapes differ from the captured one) on the side stream that
        # the capture will use, as CUDA graphs require.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = self._eager(micro_batches)
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def _eager(self, micro_batches: list[MicroBatch], cache: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._forward_backward(micro_batches, cache)
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def _forward_backward(self, micro_batches, cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward, clipping and the optimizer's step; the gradients stay for the caller."""
        n = len(micro_batches)
        loss_sum = torch.zeros((), device=_tensors(micro_batches[0])[0].device, dtype=torch.float64)
        for batch in micro_batches:
            with self.autocast(cache):
                loss = self.loss_fn(batch)
            (loss / n).backward()
            loss_sum += loss.detach().double() / n
        if self.before_clip is not None:
            self.before_clip()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        return loss_sum, grad_norm

    def _replay(self, micro_batches: list[MicroBatch]) -> tuple[torch.Tensor, torch.Tensor]:
        for static, batch in zip(self.inputs, micro_batches, strict=True):
            for held, new in zip(_tensors(static), _tensors(batch), strict=True):
                held.copy_(new)
        self.graph.replay()
        return self.outputs[0].clone(), self.outputs[1].clone()

    def _capture(self, micro_batches: list[MicroBatch]) -> bool:
        """Capture one step (recorded, not run); False, and the step stays eager, where that fails.

        The gradients are None going in, so the graph's backward allocates them in its own pool and
        every replay writes them afresh: no zeroing between replays."""
        self.inputs = [_cloned(b) for b in micro_batches]
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        try:
            # Autocast's weight-cast cache would hand the graph tensors freed after the capture.
            with torch.cuda.graph(graph, stream=self.stream):
                self.outputs = self._forward_backward(self.inputs, cache=False)
        except Exception as e:  # noqa: BLE001 (capture fails in many ways: the step stays eager, saying why)
            self.graphed, self.inputs, self.outputs = False, [], None
            self.reason = (f"graph capture failed at {failing_line(e)}: {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]}")
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            return False
        self.graph = graph
        return True


def failing_line(error: BaseException) -> str:
    """Where `error` was raised, as `file:line (function)`: the innermost frame outside torch itself,
    the code that asked for what capture forbids (torch's own frames only say which check refused it)."""
    frames = traceback.extract_tb(error.__traceback__)
    torch_root = str(Path(torch.__file__).parent)
    outside = [f for f in frames if not f.filename.startswith(torch_root)] or frames
    if not outside:
        return "an unknown place"
    frame = outside[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
