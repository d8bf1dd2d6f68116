"""Evaluation of teacher and linearized models: perplexity, lm-eval tasks, synthetic long context.

`evaluate(model, tokenizer, tasks, **options)` returns a results dict; `write_report(results, path)`
writes it as JSON + Markdown + PNG plots. `linearize eval` (command.py) wraps both.

The names load on first use (PEP 562), so the command's parser imports no torch.
"""

from linearize._lazy import lazy_exports

_EXPORTS = {"evaluate": "api", "parse_depths": "api", "parse_lengths": "api", "parse_tasks": "api",
            "write_report": "report"}

__all__ = ["evaluate", "parse_depths", "parse_lengths", "parse_tasks", "write_report"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
