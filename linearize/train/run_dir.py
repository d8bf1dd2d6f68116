"""A run directory's files, and whether a config may continue a run there or take another run's stage 1.

Each check runs before any work and raises with every differing setting named (saved there, asked here):
a changed setting is refused, never trained on top of nor reported as what the saved model was trained with.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..cli_args import first_line
from .config import DistillConfig

LOG_NAME = "train_log.jsonl"
CONFIG_NAME = "distill_config.json"
STAGE1_NAME = "stage1_attention.pt"
LAYER_ERRORS_NAME = "stage1_layer_errors.json"
LORA_NAME = "stage2_lora.pt"  # stage 2's trained adapters, which the export merges
CHECKPOINT_NAME = "checkpoint"


class ResumeError(ValueError):
    """--resume was asked for but cannot be honoured (or was needed but not asked for)."""


# Settings that shape only stage 2 or the choice of softmax layers: a run may take its stage 1 from a run
# that differs from it in these alone (`stage1_from`). "even:N" is the exception, compared apart: its
# layers are softmax during stage 1 too.
STAGE2_SETTINGS = {"stage", "softmax_by", "lr_stage2", "lora_r", "lora_alpha", "lora_dropout", "lora_targets",
                   "kl_train_steps", "kl_seq_len"}
# What KL-guided selection's candidate scores depend on beyond stage 1: where two kl:N runs agree on these,
# the scores of one are the other's.
KL_SCORING_SETTINGS = ("kl_train_steps", "lr_stage2", "lora_r", "lora_alpha", "lora_dropout", "lora_targets")
# The entries of a layer record that KL-guided selection's candidate scoring wrote (`layer_selection.KLSelection`): what
# a run taking its stage 1 copies where `same_kl_scoring`.
KL_RECORD_KEYS = ("kl_all_linear", "kl_restored", "kl_gain", "kl_train_steps", "kl_seq_len", "kl_seconds")


def stage1_source(cfg: DistillConfig) -> tuple[Path, DistillConfig, dict]:
    """The run `cfg.stage1_from` names, its config and its layer record, checked before any work: its stage 1
    finished, with every setting that shapes stage 1 as `cfg` has it (ValueError naming those that differ)."""
    source = Path(cfg.stage1_from).expanduser()
    flag = f"--stage1-from {source}"
    if source.resolve() == Path(cfg.out).expanduser().resolve():
        raise ValueError(f"{flag} is this run's own --out: name the run whose stage 1 it takes")
    missing = [name for name in (CONFIG_NAME, STAGE1_NAME, LAYER_ERRORS_NAME) if not (source / name).is_file()]
    if missing:
        raise ValueError(f"{flag}: no finished stage 1 there ({missing[0]} is missing)")
    try:
        theirs = DistillConfig.from_json(source / CONFIG_NAME)
        scores = json.loads((source / LAYER_ERRORS_NAME).read_text())
        if not isinstance(scores, dict) or not isinstance(scores.get("mse"), dict):
            raise TypeError(f"{LAYER_ERRORS_NAME} has no per-layer 'mse'")
    except (ValueError, TypeError) as e:
        reason = first_line(e)
        raise ValueError(f"{flag}: not a readable run ({reason})") from None
    differ = [name for name in cfg.same_run(theirs) if name not in STAGE2_SETTINGS]
    if _even_rule(cfg) != _even_rule(theirs):
        differ.append("softmax_by")
    if differ:
        raise ValueError(f"{flag}: its stage 1 was trained with other settings (saved there, asked here): "
                         f"{_described_changes(differ, theirs, cfg)}")
    return source, theirs, scores


def _even_rule(cfg: DistillConfig) -> str | None:
    return cfg.softmax_by if cfg.selection_rule == "even" else None


def same_kl_scoring(cfg: DistillConfig, theirs: DistillConfig, scores: dict) -> bool:
    """Whether the source run `theirs` scored KL-guided selection's candidates (its record `scores`) as `cfg`
    would: then its scores are `cfg`'s, whatever N each keeps."""
    return ("kl_restored" in scores and theirs.selection_rule == "kl"
            and all(getattr(theirs, name) == getattr(cfg, name) for name in KL_SCORING_SETTINGS)
            and (theirs.kl_seq_len or theirs.seq_len) == (cfg.kl_seq_len or cfg.seq_len))


def check_same_run(cfg: DistillConfig) -> None:
    """Raise ResumeError unless `cfg.out` holds a run started with settings `cfg` may resume."""
    out = Path(cfg.out).expanduser()
    saved = out / CONFIG_NAME
    if not saved.exists():
        raise ResumeError(f"nothing to resume in {out}: no {CONFIG_NAME}")
    try:
        previous = DistillConfig.from_json(saved)
    except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError; TypeError: unknown or missing keys
        reason = first_line(e)
        raise ResumeError(f"cannot resume {out}: {saved} is not a readable run config ({reason})") from None
    diff = cfg.same_run(previous)
    if diff:
        raise ResumeError(f"cannot resume {out} (pick a new --out for a new run): these settings differ from "
                          f"the saved run: {_described_changes(diff, previous, cfg)}")


def _described_changes(names: list[str], saved: DistillConfig, asked: DistillConfig) -> str:
    return "; ".join(change for name in names for change in _changes(name, getattr(saved, name), getattr(asked, name)))


def _changes(name: str, saved, asked) -> list[str]:
    """"NAME: saved X, asked Y" for one differing setting; for a mapping (the method's options), one per
    differing key, so that a changed window is not lost in a dozen unchanged options."""
    if isinstance(saved, dict) and isinstance(asked, dict):
        return [f"{name}.{key}: saved {_shown(saved.get(key, _UNSET))}, asked {_shown(asked.get(key, _UNSET))}"
                for key in sorted({*saved, *asked}, key=str) if saved.get(key, _UNSET) != asked.get(key, _UNSET)]
    return [f"{name}: saved {_shown(saved)}, asked {_shown(asked)}"]


_UNSET = object()  # a key one side of `_changes` lacks


def _shown(value) -> str:
    # JSON, as distill_config.json holds it (tuples as lists), on one line.
    return "unset" if value is _UNSET else json.dumps(value, default=str)


def check_saved_run(cfg: DistillConfig) -> None:
    """If `cfg.out` holds a run (its distill_config.json), raise ResumeError unless `cfg` may continue
    it, or reuse it once finished: a changed setting is refused, never trained on top of nor reported as
    what the saved model was trained with."""
    if (Path(cfg.out).expanduser() / CONFIG_NAME).exists():
        check_same_run(cfg)


def is_finished(out: str | Path) -> bool:
    """Whether the run directory `out` holds its exported model (written last)."""
    out = Path(out).expanduser()
    return ((out / CONFIG_NAME).is_file() and (out / "config.json").is_file()
            and any(out.glob("model*.safetensors")))


def nothing_to_resume(out: str | Path) -> bool:
    """Whether the run directory `out` holds no work: at most its config and its log (a run stopped before
    its first checkpoint), nothing that --resume would continue from."""
    out = Path(out).expanduser()
    return out.is_dir() and all(p.name in (CONFIG_NAME, LOG_NAME) for p in out.iterdir())
