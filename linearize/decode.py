"""Decoding with a fixed-shape cache: one token per step, optionally replayed as a CUDA graph.

A fully linearized model's cache never changes shape, so a decode step can write its new state into
the same tensors every time (`LinearizeCacheLayer.freeze`). With the step's inputs in fixed buffers
too (token, position), the whole step — 30 layers of small kernels, which in eager mode cost far more
in Python and launch overhead than in arithmetic — is captured once as a CUDA graph and replayed.
Without a GPU the same step runs eagerly, so the path is testable anywhere.

    decoder = StaticDecoder(model, cache, batch=B, cuda_graph=True)   # cache: after the prefill
    logits = decoder.step(next_tokens)                                # [B, 1, vocab]
    decoder.close()                                                   # the model's own projections back

While it is open, the model's q/k/v and gate/up projections run fused (`linearize.fused_projections`).

`compile_backend="inductor"` also runs the step through `torch.compile` before capturing it, so that
the graph replays fused kernels for the glue between the projections (RMSNorm, SiLU, casts, the gate)
instead of ~1,500 small ones at the Llama-3-8B shape. STILL's step is too large for that: dynamo
unrolls the layers, and inductor took over 6 minutes on its 30 on the H200. There only the attention
step is compiled, once, and every layer calls the same compiled function (`compile_still_steps`).
A step that fails to compile runs uncompiled.
"""

from __future__ import annotations

import torch

from .attention.base import LinearizedAttention
from .attention.still import StillAttention
from .cache import LinearizeCacheLayer, compact_softmax_layers
from .fused_projections import fuse_projections, projections_fused
from .ops.still import still_step

# The methods whose decode step reads nothing back from the device and no position as a Python
# number (STILL keeps its position in its state), so that a captured graph replays it.
GRAPH_METHODS = ("lizard", "liger", "lolcats", "still")

_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    # One side stream per device for every decoder's warm-up and capture: cuBLAS keeps a workspace
    # (tens of MiB) per stream it has run on, so a new stream per capture leaves one more behind each time.
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def graphs_wanted(model, device: torch.device, cuda_graph: bool | None) -> bool:
    """Whether a fixed-shape cache's calls replay CUDA graphs: `cuda_graph`, by default on a CUDA device,
    for the methods whose calls can be captured; True without a CUDA device is refused."""
    wanted = device.type == "cuda" if cuda_graph is None else cuda_graph
    if wanted and device.type != "cuda":
        raise ValueError("cuda_graph=True needs the model on a CUDA device")
    return wanted and (getattr(model.config, "linearize", None) or {}).get("method") in GRAPH_METHODS


def capture_graph(run, device: torch.device, *, between, pool=None):
    """(graph, output) of `run` captured on the side stream, after one warm-up run there (which compiles
    kernels outside the capture); `between` runs after the warm-up, e.g. to put back the state it wrote."""
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    between()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = run()
    return graph, output


def kept_states(layers: list[LinearizeCacheLayer]):
    """A copy of the layers' states and token counts; returns the function that puts them back (a graph's
    warm-up and capture run the model, which writes a frozen state in place)."""
    saved = [({name: t.clone() for name, t in layer.state.items()}, layer.seen) for layer in layers]

    def restore():
        for layer, (state, seen) in zip(layers, saved, strict=True):
            for name, t in layer.state.items():
                t.copy_(state[name])
            layer.seen = seen

    return restore


class StaticDecoder:
    def __init__(self, model, cache, *, batch: int, cuda_graph: bool | None = None,
                 compile_backend: str | None = None, padding: torch.Tensor | None = None):
        layers = list(getattr(cache, "layers", []))
        if not layers or not all(isinstance(layer, LinearizeCacheLayer) and layer.state is not None
                                 for layer in layers):
            raise ValueError("StaticDecoder needs the prefilled cache of a fully linearized model "
                             "(every layer linear: no softmax layers, whose caches grow)")
        method = (getattr(model.config, "linearize", None) or {}).get("method")
        self.model, self.cache, self.layers = model, cache, layers
        self.device = next(model.parameters()).device
        self.graphed = graphs_wanted(model, self.device, cuda_graph)
        for layer in layers:
            layer.freeze()
        # Fewer, larger weight reads a step (`fuse_projections`), until `close`; a model fused already
        # stays as it is, and fused, after `close`.
        self._unfuse = fuse_projections(model)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        # Left padding per row ([B]): each row's positions count from its first real token, as HF's
        # generate counts them.
        self.row_start = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        if padding is not None:
            self.row_start.copy_(padding.view(batch, 1))
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_error: str | None = None  # why capture failed, when it did
        self.closed = False
        # Compiled once at the first step: a replayed graph never calls it again. Stepping eagerly, it
        # compiles a second time as the token count changes, which dynamo then makes dynamic (`dynamic=False`
        # would compile anew at every token).
        self.compile_backend = compile_backend
        self.compile_error: str | None = None
        self._compiled = None
        self._uncompile = None  # puts back the attention steps `compile_still_steps` replaced
        if compile_backend is not None and method in GRAPH_METHODS:
            # STILL's layers take one compiled attention step; the other methods compile the whole step.
            self._uncompile = compile_still_steps(model, compile_backend)
            self._compiled = self._forward if self._uncompile else torch.compile(self._forward, backend=compile_backend)

    @property
    def path(self) -> str:
        """How the steps run, for the record."""
        if self.graphed:
            path = "cuda graph"
        else:
            path = f"eager (graph capture failed: {self.graph_error})" if self.graph_error else "eager"
        if projections_fused(self.model):
            path += ", fused projections"
        if self.compile_error:
            return f"{path}, not compiled ({self.compile_error})"
        if self._compiled is None:
            return path
        scope = ", the attention step once for every layer" if self._uncompile is not None else ""
        return f"{path}, compiled ({self.compile_backend}{scope})"

    @property
    def seen(self) -> int:
        return self.layers[0].seen

    @torch.no_grad()
    def load_row(self, row: int, cache, position: int) -> None:
        """Make row `row` continue another sequence: the state of `cache` (a batch-1 prefill of the same
        model, fully linearized) goes into the row, whose next token then sits at `position` (the
        prefill's length). The other rows go on as they were; a captured graph reads the same tensors."""
        sources = list(getattr(cache, "layers", []))
        if len(sources) != len(self.layers) or not all(isinstance(s, LinearizeCacheLayer) and s.state is not None
                                                       for s in sources):
            raise ValueError("load_row needs the prefilled cache of a fully linearized model, layer for layer")
        for layer, source in zip(self.layers, sources, strict=True):
            for name, tensor in layer.state.items():
                tensor[row].copy_(source.state[name][0])
        # Positions are the shared step count minus the row's start, which may go below 0 for a row
        # whose sequence is longer than the decoder's own.
        self.row_start[row] = self.seen - position

    def _run(self) -> torch.Tensor:
        """One step, compiled where asked and possible."""
        if self._compiled is None:
            return self._forward()
        try:
            return self._compiled()
        except Exception as e:  # noqa: BLE001 (dynamo and inductor raise many kinds: step uncompiled instead)
            # A compile fails at the first layer's call, before any layer has stored its new state.
            self._drop_compiled()
            self.compile_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            return self._forward()

    def _drop_compiled(self) -> None:
        self._compiled = None
        if self._uncompile is not None:
            self._uncompile()
            self._uncompile = None

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.tokens, past_key_values=self.cache, use_cache=True,
                         cache_position=self.position, position_ids=self.position - self.row_start,
                         logits_to_keep=1)
        return out.logits

    def close(self) -> None:
        """Give the model its own projections back (where this decoder fused them) and drop the graph,
        which read the fused ones. The cache stays as the last step left it."""
        self.graph, self.graphed = None, False
        self._drop_compiled()
        if self._unfuse is not None:
            self._unfuse()
            self._unfuse = None
        self.closed = True

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([B, 1]); returns the logits [B, 1, vocab] (a buffer reused by the next step)."""
        if self.closed:
            raise RuntimeError("this StaticDecoder is closed")
        self.tokens.copy_(tokens)
        self.position.fill_(self.seen)
        if self.graph is None and self.graphed:
            try:
                self._capture()
            except RuntimeError as e:  # something in the step cannot be captured: step eagerly instead
                self.graphed, self.graph_error = False, f"{type(e).__name__}: {str(e).splitlines()[0]}"
        if not self.graphed:
            return self._run()
        self.graph.replay()
        for layer in self.layers:  # the replay skipped the Python side of `store`
            layer.seen += 1
        return self.logits

    def _capture(self) -> None:
        # Warm-up and capture both run the step: keep the state and the token count to put them back.
        restore = kept_states(self.layers)
        try:
            # The warm-up also compiles the step, where asked.
            self.graph, self.logits = capture_graph(self._run, self.device, between=restore)
        finally:
            restore()


def compile_still_steps(model, backend: str):
    """Give every STILL layer one `torch.compile`d step function. Dynamo guards it on the inputs'
    shapes and dtypes, not on which layer's tensors they are, so it compiles once for all layers
    (what a whole-step compile, unrolled over the layers, cannot). Returns the undo, or None for a
    model without STILL layers."""
    layers = [m for m in model.modules() if isinstance(m, StillAttention)]
    if not layers:
        return None
    compiled = torch.compile(still_step, backend=backend)
    for layer in layers:
        layer.decode_step = compiled

    def undo():
        for layer in layers:
            layer.decode_step = still_step

    return undo


def fully_linearized(model) -> bool:
    """Every decoder layer's attention linearized (no softmax layers, whose caches grow): what
    StaticDecoder decodes."""
    linear = sum(isinstance(m, LinearizedAttention) for m in model.modules())
    return linear > 0 and linear == model.config.num_hidden_layers


# Tokens (over the batch) per prefill call. The state carries everything between calls, so the result is
# the one-call prefill's; what one call builds stays bounded: HF's [B, 1, L, L] masks alone are 32 GiB
# for two rows of 128K tokens.
PREFILL_TOKENS = 32768


@torch.no_grad()
def greedy_decode(model, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
                  eos_token_id: int | list[int] | None = None, cuda_graph: bool | None = None,
                  compile_backend: str | None = None, prefill_tokens: int = PREFILL_TOKENS):
    """Greedy continuation of `input_ids` [B, L] by a fully linearized model: [B, n] new tokens.

    `attention_mask` marks left padding, positions counting from each row's first real token (as
    HF's generate does). n is `max_new_tokens`, or fewer once every row has produced one of
    `eos_token_id`; a row that ended earlier goes on past its end (`until_end` cuts it). The prompt
    goes in calls of `prefill_tokens` tokens across the batch. `compile_backend`: see StaticDecoder."""
    from transformers import DynamicCache

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    positions = padding = None
    if attention_mask is not None:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        padding = attention_mask.shape[1] - attention_mask.long().sum(-1)
    cache = DynamicCache(config=model.config)
    length = input_ids.shape[1]
    step = max(1, prefill_tokens // input_ids.shape[0])
    for start in range(0, length, step):
        end = min(length, start + step)
        logits = model(input_ids=input_ids[:, start:end],
                       attention_mask=None if attention_mask is None else attention_mask[:, :end],
                       position_ids=None if positions is None else positions[:, start:end],
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    compact_softmax_layers(cache)
    token = logits[:, -1:].argmax(-1)
    generated = [token]
    ends = None if eos_token_id is None else torch.tensor(eos_token_id, device=token.device).view(-1)
    ended = None if ends is None else torch.isin(token, ends)
    decoder = StaticDecoder(model, cache, batch=input_ids.shape[0], cuda_graph=cuda_graph,
                            compile_backend=compile_backend, padding=padding)
    try:
        for _ in range(max_new_tokens - 1):
            if ended is not None and bool(ended.all()):
                break
            token = decoder.step(token)[:, -1:].argmax(-1)
            generated.append(token)
            if ended is not None:
                ended |= torch.isin(token, ends)
    finally:
        decoder.close()
    return torch.cat(generated, 1)


def until_end(tokens: torch.Tensor, eos_token_id: int | list[int] | None) -> list[list[int]]:
    """Each row of `tokens` [B, n] up to (not including) its first end-of-sequence token."""
    ends = set() if eos_token_id is None else set(torch.tensor(eos_token_id).view(-1).tolist())
    rows = []
    for row in tokens.tolist():
        cut = next((i for i, t in enumerate(row) if t in ends), len(row))
        rows.append(row[:cut])
    return rows
