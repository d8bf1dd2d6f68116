"""What every verb of the `linearize` command shares: argument types, the user-error type, atomic outputs
and the layout of the JSON files they write.

Verbs register themselves from their own modules (`train.command`, `eval.command`, ...); they import
this, never `cli`, so the command's entry point sits above them all.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

EXIT_USAGE = 2


class CommandError(Exception):
    """A problem with the user's input, reported as one line."""


def first_line(error: BaseException) -> str:
    """An exception's message as one line of an error: its first line, or its type's name where it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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


def _number(kind, noun: str, *, zero: bool):
    """A parser of finite `kind` values above 0, or from 0 with `zero`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):  # NaN compares false with everything
            wanted = f"{noun} >= 0" if zero else f"a positive {noun.split()[-1]}"
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


positive_int = _number(int, "an integer", zero=False)
positive_float = _number(float, "a number", zero=False)
non_negative_int = _number(int, "an integer", zero=True)
non_negative_float = _number(float, "a number", zero=True)


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**63), what torch's generators take."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**63 - 1, got {text!r}")
    return value


def describe_os_error(e: OSError) -> str:
    """An OSError as one line without Python's `[Errno N]` prefix: "PATH: reason"."""
    reason = e.strerror or str(e)
    return f"{e.filename}: {reason}" if e.filename else reason


def lone_surrogate_at(text: str) -> int | None:
    """The index of the first lone UTF-16 surrogate in `text`, or None: such a string is no Unicode text,
    and no tokenizer takes it (undecodable argv bytes arrive as surrogates, and JSON's `\\udXXX` escapes
    can spell half a pair)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def check_text(text: str, flag: str) -> str:
    """`text` from the command line, refused (CommandError naming `flag`) unless it is valid UTF-8: Python
    hands undecodable argv bytes over as lone surrogates. Decoding them under another charset (Latin-1?)
    would be a guess, so the user is asked for UTF-8."""
    index = lone_surrogate_at(text)
    if index is not None:
        char = text[index]
        what = (f"byte 0x{ord(char) - 0xDC00:02x}" if "\udc80" <= char <= "\udcff"
                else f"lone surrogate U+{ord(char):04X}")
        raise CommandError(f"{flag} is not valid UTF-8 text ({what} at character {index}): "
                           "pass the text encoded as UTF-8")
    return text


def check_writable_parent(out: str | Path) -> list[Path]:
    """Check that `out`'s missing parent folders can be made and `out` written: none of its ancestors is a
    file, and the nearest existing one is a folder this process may write in (checked before any work,
    not found out when the results are saved).

    Returns the missing ancestors, nearest to the root first (what `atomic_output_dir` creates)."""
    if not str(out).strip():  # Path("") is ".": the current folder
        raise CommandError("--out is empty: name the output path")
    out = Path(out).expanduser()
    missing = []
    for ancestor in out.parents:
        if ancestor.is_dir():
            if not os.access(ancestor, os.W_OK | os.X_OK):  # EROFS (a read-only mount) too, for root as well
                raise CommandError(f"cannot write {out}: the folder {ancestor} is not writable")
            break
        if ancestor.exists() or ancestor.is_symlink():
            raise CommandError(f"cannot write {out}: {ancestor} is a file, not a folder")
        missing.append(ancestor)
    return missing[::-1]


def check_new_output(out: str | Path) -> list[Path]:
    """Check that `out` can become a new output folder: it does not exist or is an empty folder, and its
    missing parents can be made. Returns those parents, as `check_writable_parent` does."""
    path = Path(out).expanduser()
    if str(out).strip() and path.exists() and (not path.is_dir() or any(path.iterdir())):
        kind = "a file" if not path.is_dir() else "a folder that is not empty"
        raise CommandError(f"output {path} already exists and is {kind}: pick a new --out")
    return check_writable_parent(out)


def check_device(device: str | None) -> None:
    """Refuse a --device this machine cannot use before anything is loaded or written (None: the default)."""
    if device is None:
        return
    import torch

    try:
        target = torch.device(device)
    except (RuntimeError, ValueError):
        raise CommandError(f"--device {device}: not a device name (cpu, cuda, cuda:1, ...)") from None
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise CommandError(f"--device {device}: no CUDA device here")
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise CommandError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif target.type == "mps" and not torch.backends.mps.is_available():
        raise CommandError(f"--device {device}: no MPS device here")


def default_device(device: str | None) -> str:
    """`--device` as given, else cuda when available, else cpu: the default of every verb that runs a model."""
    if device is not None:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def normal_permissions(folder: Path) -> None:
    """Give `folder` and the files under it the permissions mkdir and open give (0777 and 0666 less the
    umask): tempfile.mkdtemp makes folders 0700 and safetensors writes its files 0600, which would keep a
    saved model from the user's group (a shared cache, a server run as another user)."""
    mask = _umask()
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        if path.is_symlink():
            continue
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def compact_json(value, levels: int = 2, default=None) -> str:
    """`value` as JSON with a line per member of its first `levels` levels of objects and arrays, each
    member written compactly on its line: a diff names the entry that changed (a task, a measured point),
    and the file is about half the bytes of indented JSON. Every file the project commits is carried to
    each GPU call. `default` is json.dumps's (what to write for values JSON has no form for)."""
    return _layout(value, levels, "", default)


def _layout(value, levels: int, indent: str, default) -> str:
    if levels == 0 or not isinstance(value, (dict, list)) or not value:
        return json.dumps(value, separators=(",", ":"), default=default)
    inner = indent + "  "
    if isinstance(value, list):
        members = [inner + _layout(member, levels - 1, inner, default) for member in value]
        return "[\n" + ",\n".join(members) + "\n" + indent + "]"
    # A key JSON would write as text (a number, true, null) is written so here too.
    members = [f"{inner}{json.dumps(key if isinstance(key, str) else json.dumps(key))}: "
               f"{_layout(member, levels - 1, inner, default)}" for key, member in value.items()]
    return "{\n" + ",\n".join(members) + "\n" + indent + "}"


def write_text_atomic(path: Path, text: str) -> Path:
    """`text` into `path`, replacing it whole: a reader (or a resume after Ctrl-C) finds the old file or
    the new one, never half of one, and no PATH.tmp is left behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json_and_markdown(out: Path, results: dict, markdown: str) -> None:
    """`results` into OUT (compact JSON) and `markdown` into OUT with .md, each replaced whole (its folder
    made if missing): a result file and its table, as the experiments and reports leave them."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, compact_json(results) + "\n")
    write_text_atomic(out.with_suffix(".md"), markdown)


@contextmanager
def atomic_output_dir(out: str | Path):
    """Yield a scratch directory that becomes `out` only if the block succeeds.

    It is made next to `out` first (with any missing parent folders), so an unwritable destination
    fails before any real work, and an error or Ctrl-C leaves nothing half-written behind: not the
    scratch directory, nor the parents made for it. `out` and the files in it get the permissions
    mkdir and open give (0777 and 0666 less the umask).
    """
    missing = check_new_output(out)
    out = Path(out).expanduser()
    parent = out.parent if str(out.parent) else Path(".")
    made = []
    try:
        for folder in missing:
            folder.mkdir()
            made.append(folder)
        scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=parent))
    except OSError as e:
        for folder in reversed(made):
            folder.rmdir()
        raise CommandError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        yield scratch
        normal_permissions(scratch)
        if out.exists():
            out.rmdir()
        scratch.rename(out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                pass
        raise


def read_json_files(parser: argparse.ArgumentParser, paths: list[Path], what: str,
                    problem: Callable[[object], str | None]) -> list[tuple[Path, object]]:
    """[(path, its JSON)] for every path, all read before any is used; else the parser's one-line exit 2
    naming the first file that is not a readable `what` or, by `problem(value)` (why not, or None), not one."""
    loaded = []
    for path in paths:
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            parser.exit(2, f"error: {path}: not a readable {what} ({e.__class__.__name__})\n")
        reason = problem(value)
        if reason:
            parser.exit(2, f"error: {path}: not a {what} ({reason})\n")
        loaded.append((path, value))
    return loaded
