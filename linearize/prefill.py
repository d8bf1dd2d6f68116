"""A one-sequence prefill in chunks into a fixed-shape cache, each chunk replayed from a CUDA graph.

An eager forward of a few tokens costs an 8B model tens of milliseconds of Python and kernel launches,
several times a decode step that replays a graph: a server that slips a small prefill chunk between
decode steps (`linearize serve --prefill-budget`) would stall its running requests for that long.
A fully linearized model's state has one shape whatever the prompt's length, so a chunk of a given
size always runs the same kernels on the same tensors: it is captured once per size and replayed.

    prefill = StaticPrefill(model, sizes=(1, 2, 4, ..., 1024))
    prefill.reset()                            # a new sequence
    logits = prefill.run(prompt_ids[:1024])    # a captured size: [1, 1, vocab], the last token's
    logits = prefill.run(prompt_ids[1024:1536])
    decoder.load_row(slot, prefill.cache, 1536)

Each size has two graphs: the sequence's first chunk (the fresh path: no state read) and a later one
(continuing the cache's state). A chunk of a size not captured, or every chunk where graphs are off
(no GPU, or a capture that failed: `graph_error` says why), runs eagerly into the same cache, with
the same result. The logits returned are overwritten by the next `run`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .cache import LinearizeCacheLayer
from .decode import capture_graph, fully_linearized, graphs_wanted, kept_states


def power_of_two_sizes(largest: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to `largest` (at least 1): any chunk is cut into at most log2 of these."""
    return tuple(1 << i for i in range(max(1, largest).bit_length()))


def largest_size(sizes: tuple[int, ...], tokens: int) -> int:
    """The largest of `sizes` no greater than `tokens` (>= 1), or `tokens` when none is."""
    return max((s for s in sizes if s <= tokens), default=tokens)


class StaticPrefill:
    def __init__(self, model, *, sizes: tuple[int, ...], cuda_graph: bool | None = None):
        if not fully_linearized(model):
            raise ValueError("StaticPrefill needs a fully linearized model (every layer linear: no softmax "
                             "layers, whose caches grow)")
        self.model = model
        self.device = next(model.parameters()).device
        self.sizes = tuple(sorted(set(sizes)))
        self.graphed = graphs_wanted(model, self.device, cuda_graph)
        self.graph_error: str | None = None
        # Every layer's state at its fixed shape, from one token; `reset` makes it a new sequence.
        self.cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), past_key_values=self.cache,
                  use_cache=True, logits_to_keep=1)
        self.layers: list[LinearizeCacheLayer] = list(self.cache.layers)
        for layer in self.layers:
            layer.freeze()
            layer.unpadded = True  # one sequence, never padded
        # Per (first chunk, size): the token and position buffers the graph reads, its logits, the graph.
        self._graphs: dict[tuple[bool, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.cuda.CUDAGraph]] = {}
        # One memory pool for every graph: they replay one at a time.
        self._pool = torch.cuda.graph_pool_handle() if self.graphed else None
        self.reset()

    @property
    def seen(self) -> int:
        return self.layers[0].seen

    @property
    def path(self) -> str:
        """How the chunks run, for the record."""
        if self.graphed:
            return f"cuda graphs ({len(self._graphs)} captured)"
        return f"eager (graph capture failed: {self.graph_error})" if self.graph_error else "eager"

    def reset(self) -> None:
        """Start a new sequence: the next chunk takes the fresh path, which reads no state."""
        for layer in self.layers:
            layer.seen = 0

    def capture(self) -> None:
        """Capture every size's two graphs now (a server does it before it takes requests), so that
        no later chunk waits for a capture."""
        for first in (True, False):
            for size in self.sizes:
                self._graph(first, size)  # none once one has failed

    @torch.no_grad()
    def run(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Prefill the next tokens of the sequence; returns the last one's logits [1, 1, vocab]."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        size = ids.shape[1]
        positions = torch.arange(self.seen, self.seen + size, device=self.device).view(1, -1)
        entry = self._graph(self.seen == 0, size) if size in self.sizes else None
        if entry is None:
            return self._forward(ids, positions)
        tokens, position_buffer, logits, graph = entry
        tokens.copy_(ids)
        position_buffer.copy_(positions)
        graph.replay()
        for layer in self.layers:  # the replay skipped the Python side of `store`
            layer.seen += size
        return logits

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, past_key_values=self.cache, use_cache=True,
                          cache_position=positions[0], position_ids=positions, logits_to_keep=1).logits

    def _graph(self, first: bool, size: int):
        """The graph of a first or later chunk of `size` tokens, captured at its first use; None (and
        graphs off from then on) if capture fails."""
        key = (first, size)
        if key in self._graphs or not self.graphed:
            return self._graphs.get(key)
        restore = kept_states(self.layers)  # warm-up and capture both run the chunk
        tokens = torch.zeros(1, size, dtype=torch.long, device=self.device)
        # A later chunk's positions: any past the first chunk's, as the replay overwrites them.
        positions = torch.arange(size, device=self.device).view(1, -1) + (0 if first else size)

        def take_path():  # which path the chunk takes, fresh or continuing, in the warm-up and the capture
            for layer in self.layers:
                layer.seen = 0 if first else size

        try:
            take_path()
            graph, logits = capture_graph(lambda: self._forward(tokens, positions), self.device, between=take_path,
                                          pool=self._pool)
            self._graphs[key] = (tokens, positions, logits, graph)
        except RuntimeError as e:  # something in the chunk cannot be captured: run chunks eagerly instead
            self.graphed, self.graph_error = False, f"{type(e).__name__}: {str(e).splitlines()[0]}"
        finally:
            restore()
        return self._graphs.get(key)
