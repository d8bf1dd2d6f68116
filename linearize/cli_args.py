"""What every verb of the `linearize` command shares: argument types, the user-error type, atomic outputs.

Verbs register themselves from their own modules (`train.command`, `eval.command`, ...); they import
this, never `cli`, so the command's entry point sits above them all.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

EXIT_USAGE = 2


class CommandError(Exception):
    """A problem with the user's input, reported as one line."""


def parse_int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


class StoreGiven(argparse.Action):
    """Store the value and note that the user gave the flag, so a preset's default does not replace it."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


def add_method_arguments(parser: argparse.ArgumentParser, methods, presets: dict) -> None:
    """`--method NAME` or `--preset NAME` (one of the two, required). A preset (`linearize.config.Preset`)
    sets `method`, puts its options before the user's `--set` ones, and sets its `distill_defaults` on
    flags of this parser that the user did not give (flags given through `StoreGiven`)."""

    class PresetAction(argparse.Action):
        def __call__(self, parser, namespace, name, option_string=None):
            preset = presets[name]
            namespace.preset, namespace.method = name, preset.method
            namespace.set = [*(f"{key}={value}" for key, value in preset.options.items()), *(namespace.set or [])]
            for dest, value in preset.distill_defaults.items():
                if hasattr(namespace, dest) and dest not in getattr(namespace, "given", ()):
                    setattr(namespace, dest, value)

    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--method", choices=sorted(methods), help="the attention that replaces softmax "
                       "(lizard: the paper's Lizard); see docs/methods.md")
    which.add_argument("--preset", choices=sorted(presets), action=PresetAction,
                       help="a method with recommended options instead of --method: "
                            + "; ".join(f"{name}: {p.summary}" for name, p in presets.items()))


def _positive(kind, noun: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {noun.split()[-1]}, got {text!r}")
        return value

    return parse


positive_int = _positive(int, "an integer")
positive_float = _positive(float, "a number")


@contextmanager
def atomic_output_dir(out: str | Path):
    """Yield a scratch directory that becomes `out` only if the block succeeds.

    It is made next to `out` first, so an unwritable destination fails before any real work, and an
    error or Ctrl-C leaves nothing half-written behind.
    """
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CommandError(f"output {out} already exists and is not an empty directory")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise CommandError(f"cannot write {out}: parent directory {parent} does not exist")
    try:
        scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=parent))
    except OSError as e:
        raise CommandError(f"cannot write {out}: {e.strerror}") from None
    try:
        yield scratch
        if out.exists():
            out.rmdir()
        scratch.rename(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
