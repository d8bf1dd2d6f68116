"""The options of the gated delta-rule op, in one object every form takes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class DeltaRuleOptions:
    """scale  the read-out's scale: o_t = scale * S_t^T q_t (1: the unit-norm query reads the value as written)
    eps    the epsilon of the queries' and keys' L2 normalisation, x / sqrt(|x|^2 + eps)
    chunk  tokens per chunk of the chunked PyTorch form
    """

    scale: float = 1.0
    eps: float = 1e-6
    chunk: int = 64

    def replace(self, **changes) -> DeltaRuleOptions:
        return dataclasses.replace(self, **changes)
