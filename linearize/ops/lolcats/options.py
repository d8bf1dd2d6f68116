"""The options of LoLCATs' op, in one object every form takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class LolcatsOptions:
    """window  the softmax window w (the last w tokens; linear attention before them)
    scale   the softmax scale (the teacher's)
    factor  [H] the window's share of the shared normaliser per head, in (0, 1)
    eps     the denominator's epsilon
    """

    window: int
    scale: float
    factor: torch.Tensor
    eps: float = 1e-6
