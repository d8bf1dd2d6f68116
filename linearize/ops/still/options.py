"""The options of STILL's op, in one object every form and the routing take."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StillOptions:
    """window   the softmax window W (each query sees the last W tokens, itself included)
    chunk      tokens per routing chunk
    per_chunk  salient slots each complete chunk may claim
    routing    how tokens are ranked (`routing.ROUTINGS`)
    scale      the softmax scale (the teacher's)
    eps        the denominator's epsilon
    """

    window: int
    chunk: int
    per_chunk: int
    routing: str
    scale: float
    eps: float = 1e-6
