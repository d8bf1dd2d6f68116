"""The memory policy of the batched KV rows (kv and hybrid modes): which waiting request fits beside the
admitted ones.

A full-attention layer's keys and values grow with every token, and `BatchedKVCache` holds rows x capacity
positions of them, every row as long as the longest. So the admitted requests can take rows x their
longest reach (prompt + `max_tokens`) of them, and the prefill in progress holds its own cache beside the
rows until it is copied into its row. A sliding-window layer's ring grows the same way up to its window
and no further; a linearized layer's state has one fixed size and is not counted. A request is admitted
while all of that fits `limit` bytes; one that could never fit alone is refused at once.
"""

from __future__ import annotations

import torch

from ..architectures import FULL, SLIDING, sliding_window_of
from . import kv_slots
from .request import Request

# The default budget on a GPU: this share of the memory free when the engine starts, less the room a
# step's attention works in (`kv_slots.step_bytes_per_token`).
KV_MEMORY_SHARE = 0.9


def admitted_limits(admitted: list[Request]) -> tuple[int, int]:
    """The rows and capacity the admitted requests can reach: what the buffers may grow to."""
    return len(admitted), max((r.reach for r in admitted), default=0)


class KVBudget:
    """Bytes of keys and values the admitted requests may reach (`limit`; None: no limit), of a model
    whose layers hold `kinds` of rows (`kv_slots.layer_kinds`)."""

    def __init__(self, config, dtype: torch.dtype, limit: int | None, kinds: list[str]):
        if limit is not None and limit < 1:
            raise ValueError(f"kv_budget_bytes must be >= 1, got {limit}")
        self.limit = limit
        # Per token: the full layers' keys and values, which grow with it, and the sliding layers', which
        # grow with it up to `window` positions.
        self.bytes_per_token = kv_slots.kv_bytes_per_token(config, dtype, kinds.count(FULL))
        self.window_bytes_per_token = kv_slots.kv_bytes_per_token(config, dtype, kinds.count(SLIDING))
        self.window = sliding_window_of(config) or 0
        self.step_bytes_per_token = kv_slots.step_bytes_per_token(config, dtype)

    def default_for(self, device: torch.device, set_aside: int = 0) -> int:
        """KV_MEMORY_SHARE of the memory this process can still take on `device` (a GPU: free, and what
        torch holds cached unused) less `set_aside` bytes (what the prefix cache may fill, on its own
        budget), of which a step's attention keeps its working room."""
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) - set_aside
        per_token = self.bytes_per_token + self.window_bytes_per_token
        return max(1, int(KV_MEMORY_SHARE * free * per_token / (per_token + self.step_bytes_per_token)))

    def bytes(self, rows: int, reach: int, prefill: int) -> int:
        """What `rows` rows of `reach` positions and a prefill of `prefill` tokens take."""
        window = self.window_bytes_per_token * (rows * min(reach, self.window) + min(prefill, self.window))
        return (rows * reach + prefill) * self.bytes_per_token + window

    def fits(self, request: Request, admitted: list[Request], prefilling: list[Request]) -> bool:
        """Whether `request` may join the `admitted` ones (of which `prefilling` are still prefilling)."""
        if self.limit is None:
            return True
        reach = max(r.reach for r in [*admitted, request])
        prefill = max(r.prompt_tokens for r in [*prefilling, request])
        return self.bytes(len(admitted) + 1, reach, prefill) <= self.limit

    def too_big_alone(self, request: Request) -> str | None:
        """Why `request` could never fit, even alone; None if it could (or there is no limit)."""
        if self.limit is None:
            return None
        need = self.bytes(1, request.reach, request.prompt_tokens)
        if need <= self.limit:
            return None
        return (f"the request's KV cache ({request.prompt_tokens} prompt tokens + max_tokens "
                f"{request.params.max_tokens}, and its prefill) would take {need / 2**20:.1f} MiB, more than the "
                f"engine's KV budget of {self.limit / 2**20:.1f} MiB on its own: ask for fewer tokens")

    def prefill_needs_room(self, held_bytes: int, prompt_tokens: int) -> bool:
        """Whether a prefill of `prompt_tokens` beside buffers of `held_bytes` would pass the budget."""
        return self.limit is not None and held_bytes + self.bytes(0, 0, prompt_tokens) > self.limit
