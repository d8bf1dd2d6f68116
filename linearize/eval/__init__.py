"""Evaluation of teacher and linearized models: perplexity, lm-eval tasks, synthetic long context.

`evaluate(model, tokenizer, tasks, **options)` returns a results dict; `write_report(results, path)`
writes it as JSON + Markdown + PNG plots. `linearize eval` (command.py) wraps both.

The names load on first use (PEP 562), so the command's parser imports no torch.
"""

import importlib

_EXPORTS = {"evaluate": "api", "parse_depths": "api", "parse_lengths": "api", "parse_tasks": "api",
            "write_report": "report"}

__all__ = ["evaluate", "parse_depths", "parse_lengths", "parse_tasks", "write_report"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
