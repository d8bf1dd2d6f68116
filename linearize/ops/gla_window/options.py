"""The options of the gated-linear-attention-plus-window op, in one object every form takes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class GlaWindowOptions:
    """How one layer mixes its two branches (`linearize.ops.gla_window`'s formula):

    window     the softmax window w: each query sees keys (i - w, i]
    scale      the window's score scale (the teacher's)
    alpha      [H] the window's weight per head (unused with `shared`)
    sinks      [H, M] sink logits in the window's softmax, or None
    beta       the linear part's weight
    normalize  False: the linear part is phi_q^T S alone, no denominator (Liger's form)
    shared     both branches share one normaliser
    eps        the linear denominator's epsilon
    chunk      tokens per chunk of the chunked PyTorch form
    """

    window: int
    scale: float
    alpha: torch.Tensor
    sinks: torch.Tensor | None = None
    beta: float = 1.0
    normalize: bool = True
    shared: bool = False
    eps: float = 1e-6
    chunk: int = 64

    def head_scalars_in(self, dtype: torch.dtype) -> GlaWindowOptions:
        """These options with sinks and alpha in `dtype` (the multi-token kernels and the PyTorch forms
        take them in float32; a bf16 model keeps them in bf16, and only its decode steps take them so)."""
        return dataclasses.replace(self, alpha=self.alpha.to(dtype),
                                   sinks=None if self.sinks is None else self.sinks.to(dtype))

    def replace(self, **changes) -> GlaWindowOptions:
        return dataclasses.replace(self, **changes)
