"""Evaluation of teacher and linearized models: perplexity, lm-eval tasks, synthetic long context.

`evaluate(model, tokenizer, tasks, **options)` returns a results dict; `write_report(results, path)`
writes it as JSON + Markdown + PNG plots. `linearize eval` (command.py) wraps both.
"""

from linearize.eval.api import evaluate, parse_depths, parse_lengths, parse_tasks
from linearize.eval.report import write_report

__all__ = ["evaluate", "parse_depths", "parse_lengths", "parse_tasks", "write_report"]
