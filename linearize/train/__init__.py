"""Distillation: stage 1 attention transfer, stage 2 LoRA (see distillation.py).

The names load on first use (PEP 562), so the command's parser imports no torch.
"""

import importlib

_EXPORTS = {"DistillConfig": "config", "ResumeError": "distillation", "distill": "distillation",
            "ensure_distilled": "distillation"}

__all__ = ["DistillConfig", "ResumeError", "distill", "ensure_distilled"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
