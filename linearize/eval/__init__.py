"""Evaluation of teacher and linearized models: perplexity, lm-eval tasks, synthetic long context.

`evaluate(model, tokenizer, tasks, **options)` (or `evaluate(model, tokenizer, EvalConfig(...))`) returns a
results dict; `write_report(results, path)`
writes it as JSON + Markdown + PNG plots. `linearize eval` (command.py) wraps both.

The names load on first use (PEP 562), so the command's parser imports no torch.
"""

from linearize._lazy import lazy_exports

_EXPORTS = {"EvalConfig": "config", "evaluate": "api", "parse_depths": "tasks", "parse_lengths": "tasks",
            "parse_tasks": "tasks", "write_report": "report"}

__all__ = ["EvalConfig", "evaluate", "parse_depths", "parse_lengths", "parse_tasks", "write_report"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
