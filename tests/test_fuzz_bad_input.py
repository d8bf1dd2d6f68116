"""Bad input never costs the user anything: a fuzzer over every file `linearize` reads and every verb's flags.

Each example copies a small workspace (a tiny teacher folder, a distilled run, data in every format we
read, a recipe, a text), breaks ONE input (a file truncated, emptied, garbled, bit-flipped or swapped
for a file of another kind; or a flag given a hostile value: NaN, inf, negative, huge, empty, the wrong
type, a path that is a file, a path under a missing folder), runs the verb in-process and checks the
README's promise:
  - `main` returns 0 (the input was still valid) or 2; no exception ever escapes it (a traceback);
  - on 2, stderr is exactly one line, `linearize: error: ...`, naming the input it refused (after the
    progress bars of work that ran, where the refusal came mid-run: an --lr that diverges);
  - on 2, nothing is left behind, and on either, no file of the user's is changed.

`make test` runs a fixed, derandomized set of examples (seconds); `pytest -m slow -s
tests/test_fuzz_bad_input.py` runs FUZZ_EXAMPLES (default 1000) drawn ones for files and for flags
(the same ones every run; FUZZ_RANDOM=1 draws new ones) and prints the
tally that docs/setup.md quotes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import save_tiny_teacher

from linearize.cli import main

TALLY: Counter = Counter()
SLOW_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1000"))
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "and", "then", "came", "back", "home"]
GGUF_PREFIX = 1 << 20  # bytes of the real teacher's GGUF a fuzzed copy starts from


# ----------------------------------------------------------------------------------------------------
# The workspace: one of every input, built once per module and copied for each example.


def _text(rng: random.Random, n: int = 120) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-template")
    rng = random.Random(0)
    save_tiny_teacher(root / "teacher")
    (root / "data.txt").write_text("\n".join(_text(rng) for _ in range(30)))
    (root / "data.jsonl").write_text("\n".join(json.dumps({"text": _text(rng)}) for _ in range(30)) + "\n")
    (root / "data.json").write_text(json.dumps([{"instruction": _text(rng, 8), "input": "", "output": _text(rng, 40)}
                                                for _ in range(30)]))
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": [_text(rng) for _ in range(30)]}).save_to_disk(str(root / "data.arrow"))
    (root / "essay.txt").write_text("\n".join(_text(rng) for _ in range(20)))
    with _quiet_cache(root / "cache"):
        code, _, err = _run(["distill", "--model", root / "teacher", "--method", "lizard", "--data", root / "data.txt",
                             "--out", root / "run", "--stage", "1", "--max-tokens", "128", "--seq-len", "32",
                             "--batch", "2", "--save-every", "1"])
    assert code == 0, err
    (root / "recipe.yaml").write_text(
        f"row: tiny\nmodel: {root / 'teacher'}\n"
        "distill:\n  method: lizard\n  stage: '1'\n  max_tokens: 64\n  seq_len: 32\n  batch: 2\n"
        f"  data: {root / 'data.txt'}\n"
        "eval:\n  tasks: ppl\n  lengths: '32'\n  limit: 1\n")
    from linearize import assets

    gguf = Path(assets.cache_dir()) / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if gguf.is_file():  # else (no assets fetched) the GGUF kind is skipped
        with gguf.open("rb") as f:
            (root / "teacher.gguf").write_bytes(f.read(GGUF_PREFIX))
    shutil.rmtree(root / "cache", ignore_errors=True)
    return root


@contextlib.contextmanager
def _quiet_cache(cache: Path):
    """Token blocks go to a cache outside the workspace (the user's own cache is not the workspace)."""
    before = os.environ.get("LINEARIZE_CACHE")
    os.environ["LINEARIZE_CACHE"] = str(cache)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LINEARIZE_CACHE", None)
        else:
            os.environ["LINEARIZE_CACHE"] = before


def _run(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


class Hang(BaseException):
    """An example ran past its deadline (BaseException: the command's own handlers must not swallow it)."""


@contextlib.contextmanager
def _deadline(seconds: int, label: str):
    def expire(*_):
        raise Hang(f"{label}: still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under `root`, with the files' hashes."""
    state = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        state[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return state


# ----------------------------------------------------------------------------------------------------
# What breaks: a file of the workspace, and the commands that read it.

# name: (the file to break, relative to the workspace; the commands reading it, with OUT for a fresh output)
FILES = {
    "safetensors": ("teacher/model.safetensors", ["convert", "generate", "eval"]),
    "config": ("teacher/config.json", ["convert", "generate", "eval", "distill"]),
    "tokenizer": ("teacher/tokenizer.json", ["generate", "eval", "distill"]),
    "tokenizer-config": ("teacher/tokenizer_config.json", ["generate", "eval", "distill"]),
    "gguf": ("teacher.gguf", ["convert", "generate", "eval", "distill"]),
    "txt": ("data.txt", ["distill"]),
    "jsonl": ("data.jsonl", ["distill"]),
    "json": ("data.json", ["distill"]),
    "arrow": ("data.arrow/data-00000-of-00001.arrow", ["distill"]),
    "essay": ("essay.txt", ["eval"]),
    "recipe": ("recipe.yaml", ["recipe"]),
    "checkpoint": ("run/checkpoint", ["resume"]),
    "run-config": ("run/distill_config.json", ["resume"]),
    "student": ("run/model.safetensors", ["generate-run", "eval-run"]),
    "student-config": ("run/config.json", ["generate-run", "eval-run"]),
}


def command(verb: str, ws: Path, model: Path, data: Path | None = None) -> list:
    """The argv of `verb` on the workspace's inputs, writing under ws/out (which must not exist)."""
    out = ws / "out"
    tiny = ["--max-new-tokens", "3"]
    return {
        "convert": ["convert", "--model", model, "--method", "lizard", "--out", out],
        "generate": ["generate", "--model", model, "--prompt", "the cat", *tiny],
        "generate-run": ["generate", "--model", ws / "run", "--prompt", "the cat", *tiny],
        "eval": ["eval", "--model", model, "--tasks", "ppl", "--lengths", "32", "--limit", "1",
                 "--text", ws / "essay.txt", "--out", out / "e.json"],
        "eval-run": ["eval", "--model", ws / "run", "--tasks", "ppl", "--lengths", "32", "--limit", "1",
                     "--text", ws / "essay.txt", "--out", out / "e.json"],
        "distill": ["distill", "--model", model, "--method", "lizard", "--data", data or ws / "data.txt",
                    "--out", out, "--stage", "1", "--max-tokens", "64", "--seq-len", "32", "--batch", "2"],
        "resume": ["distill", "--model", ws / "teacher", "--method", "lizard", "--data", ws / "data.txt",
                   "--out", ws / "run", "--stage", "1", "--max-tokens", "128", "--seq-len", "32", "--batch", "2",
                   "--save-every", "1", "--resume"],
        "recipe": ["recipe", "run", ws / "recipe.yaml", "--out", out, "--device", "cpu"],
    }[verb]


def corrupt(path: Path, how: str, rng: random.Random, other: Path) -> None:
    """Break `path` (a file, or every file of a folder) in place."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files if how != "other" else files[:1]:
        data = file.read_bytes()
        if how == "truncate":
            data = data[: rng.randrange(len(data))] if data else data
        elif how == "empty":
            data = b""
        elif how == "random":
            data = rng.randbytes(rng.choice([1, 17, 1000, 70_000]))
        elif how == "flip":
            data = bytearray(data)
            for _ in range(max(1, len(data) // 200)):
                if data:
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            data = bytes(data)
        elif how == "text":
            data = rng.choice([b"{}", b"[]", b"null", b"not json at all", b"\xff\xfe\x00garbage", b"{\"a\": "])
        elif how == "other":
            data = other.read_bytes()
        file.write_bytes(data)


CORRUPTIONS = ["truncate", "empty", "random", "flip", "text", "other"]


def check_file_example(template: Path, kind: str, how: str, verb: str, seed: int) -> None:
    rel, _ = FILES[kind]
    if kind == "gguf" and not (template / rel).exists():
        pytest.skip("the teacher's GGUF is not fetched (make setup)")
    with tempfile.TemporaryDirectory() as tmp, _quiet_cache(Path(tmp) / "cache"):
        ws = Path(tmp) / "ws"
        shutil.copytree(template, ws)
        target = ws / rel
        corrupt(target, how, random.Random(seed), other=ws / ("data.txt" if kind != "txt" else "teacher/config.json"))
        model = ws / "teacher.gguf" if kind == "gguf" else ws / "teacher"
        data = target if kind in ("txt", "jsonl", "json") else ws / "data.arrow" if kind == "arrow" else None
        argv = command(verb, ws, model, data)
        names = {target.name, target.parent.name, Path(rel).parts[0]}
        if kind == "recipe":  # a garbled value inside it is named as the value it became (a path, a model)
            names |= {"Data path", "data", "model"}
        check(ws, argv, names, f"{kind}/{how}/{verb}")


PROGRESS_FRAME = re.compile(r"[^:|]+: +\d+%\|")  # tqdm's "stage 1:  40%|####  | 2/5 [...]"


def check(ws: Path, argv: list, names: set[str], label: str) -> None:
    """Run argv and hold it to the promise; `names`: words one of which the error line must contain."""
    before = _snapshot(ws)
    try:
        with contextlib.chdir(ws), _deadline(EXAMPLE_SECONDS, label):  # relative or empty paths land in ws
            code, _, err = _run(argv)
    except Hang:
        TALLY["hang"] += 1
        raise
    except BaseException as e:  # anything escaping main is the traceback a user would see
        TALLY["traceback"] += 1
        raise AssertionError(f"{label}: {type(e).__name__} escaped main: {e}") from e
    after = _snapshot(ws)
    changed = sorted(p for p in before if p in after and after[p] != before[p])
    assert not changed, f"{label}: changed the user's files {changed[:5]}"
    # Progress-bar frames are the work that ran before a refusal found mid-run (a diverging --lr).
    lines = [line for line in err.splitlines() if line.strip() and not PROGRESS_FRAME.match(line)]
    if code == 0:
        TALLY["accepted"] += 1
        return
    TALLY["refused"] += 1
    assert code == 2, f"{label}: exit {code}: {err[-2000:]}"
    assert len(lines) == 1 and re.match(r"linearize( \w+)*: error: ", lines[0]), f"{label}: stderr was {lines[-5:]}"
    assert any(name and name in lines[0] for name in names), f"{label}: {lines[0]!r} names none of {names}"
    left = sorted(set(after) - set(before))
    if left:
        TALLY["leftover"] += 1
    assert not left, f"{label}: left behind {left[:5]}"


# ----------------------------------------------------------------------------------------------------
# Hostile flag values.

HOSTILE = ["nan", "inf", "-inf", "-1", "0", "1e400", "", "abc", "1.5", "99999999999999999999", "-0"]
# Flags whose large values are valid requests for more work (tokens, steps, samples): no huge values there.
SIZES = {"--max-tokens", "--max-new-tokens", "--seq-len", "--batch", "--grad-accum", "--save-every", "--eval-every",
         "--limit", "--samples", "--lengths"}
EXAMPLE_SECONDS = 120  # a valid input on the tiny workspace finishes in seconds; longer is a hang
# verb: flags that take a number
NUMERIC = {
    "convert": [],
    "generate": ["--max-new-tokens", "--temperature", "--seed"],
    "eval": ["--limit", "--lengths", "--samples", "--batch", "--seed", "--depths"],
    "distill": ["--max-tokens", "--seq-len", "--batch", "--grad-accum", "--lr", "--head-lr-scale",
                "--save-every", "--eval-every", "--seed", "--softmax-layers"],
}
SET_KEYS = ["window", "eps", "gate_temperature", "num_sinks", "feature_dim", "chunk_size", "alpha_init",
            "gate_bias_init"]
PATHS = ["file-as-dir", "missing-parent", "empty", "file"]


def with_flag(argv: list, flag: str, value: str) -> list:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


def check_flag_example(template: Path, verb: str, flag: str, value: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, _quiet_cache(Path(tmp) / "cache"):
        ws = Path(tmp) / "ws"
        shutil.copytree(template, ws)
        # --set changes a linearized model: the distilled run's
        argv = with_flag(command("generate-run" if flag == "--set" else verb, ws, ws / "teacher"), flag, value)
        key = value.split("=")[0] if flag == "--set" else flag.lstrip("-")
        names = {flag, key, key.replace("-", "_"), *([value] if len(value) > 1 and flag != "--set" else [])}
        check(ws, argv, names, f"{verb} {flag} {value!r}")


def check_path_example(template: Path, verb: str, how: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, _quiet_cache(Path(tmp) / "cache"):
        ws = Path(tmp) / "ws"
        shutil.copytree(template, ws)
        argv = command(verb, ws, ws / "teacher")
        flag = "--out" if how != "file" else "--model"
        target = {"file-as-dir": ws / "data.txt" / "sub", "missing-parent": ws / "nowhere" / "deeper" / "out",
                  "empty": "", "file": ws / "data.txt"}[how]
        if verb == "eval" and how != "file" and target:
            target = Path(target) / "e.json"
        argv = with_flag(argv, flag, str(target))
        names = {flag, "data.txt", "nowhere", "deeper", "out", "e.json", "model", "output"}
        check(ws, argv, names, f"{verb} {flag} {how}")


# A cache folder that cannot be made: LINEARIZE_CACHE under /proc, under a file, or a file itself.
CACHES = ["proc", "file-as-dir", "file"]


def check_cache_example(template: Path, verb: str, how: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, _quiet_cache(Path(tmp) / "cache"):
        ws = Path(tmp) / "ws"
        shutil.copytree(template, ws)
        # The alias's dense copy lives in the cache; distill keeps its token blocks there.
        argv = command(verb, ws, ws / "teacher") if verb != "generate" else with_flag(
            command(verb, ws, ws / "teacher"), "--model", "smollm2")
        os.environ["LINEARIZE_CACHE"] = str({"proc": Path("/proc/linearize-cache"), "file-as-dir": ws / "data.txt" / "c",
                                             "file": ws / "data.txt"}[how])
        check(ws, argv, {"LINEARIZE_CACHE"}, f"{verb} LINEARIZE_CACHE={how}")


# ----------------------------------------------------------------------------------------------------
# The tests: a fixed set by default, random ones when marked slow.

FAST_FILE_CASES = [(kind, how, verbs[i % len(verbs)], i)
                   for i, (kind, (_, verbs)) in enumerate(FILES.items())
                   for how in (CORRUPTIONS[i % len(CORRUPTIONS)], "empty")]


@pytest.mark.parametrize("kind,how,verb,seed", FAST_FILE_CASES,
                         ids=[f"{k}-{h}-{v}" for k, h, v, _ in FAST_FILE_CASES])
def test_broken_file_is_refused_cleanly(template, kind, how, verb, seed):
    check_file_example(template, kind, how, verb, seed)


FAST_FLAG_CASES = [(verb, flag, HOSTILE[i % len(HOSTILE)]) for verb, flags in NUMERIC.items()
                   for i, flag in enumerate(flags)]
FAST_FLAG_CASES += [("generate", "--set", f"{key}={HOSTILE[i % 4]}") for i, key in enumerate(SET_KEYS)]
FAST_FLAG_CASES += [("generate", "--prompt", ""), ("convert", "--method", "nope"), ("eval", "--tasks", "nope")]
# Undecodable argv bytes (lone surrogates in Python), a length or a budget that trains nothing.
FAST_FLAG_CASES += [("generate", "--prompt", "caf\udce9"), ("distill", "--seq-len", "1"), ("distill", "--max-tokens", "40")]
FAST_FLAG_CASES += [("distill", "--softmax-by", value) for value in ("kl:x", "foo:2", "kl:2", "even:99", "nan", "")]


@pytest.mark.parametrize("verb,flag,value", FAST_FLAG_CASES,
                         ids=[f"{v}{f}={x!r}" for v, f, x in FAST_FLAG_CASES])
def test_hostile_flag_value_is_refused_cleanly(template, verb, flag, value):
    check_flag_example(template, verb, flag, value)


@pytest.mark.parametrize("verb", ["convert", "eval", "distill"])
@pytest.mark.parametrize("how", PATHS)
def test_bad_output_or_model_path_is_refused_cleanly(template, verb, how):
    check_path_example(template, verb, how)


@pytest.mark.parametrize("verb", ["generate", "distill"])
@pytest.mark.parametrize("how", CACHES)
def test_an_unusable_cache_folder_is_refused_cleanly(template, verb, how):
    check_cache_example(template, verb, how)


# The same examples every run (CI must not flake on a draw); FUZZ_RANDOM=1 explores new ones.
SLOW = settings(max_examples=SLOW_EXAMPLES, deadline=None, database=None,
                derandomize=not os.environ.get("FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_fuzz_broken_files(template, data):
    kind = data.draw(st.sampled_from(sorted(FILES)), "kind")
    verb = data.draw(st.sampled_from(FILES[kind][1]), "verb")
    check_file_example(template, kind, data.draw(st.sampled_from(CORRUPTIONS), "how"), verb,
                       data.draw(st.integers(0, 2**32 - 1), "seed"))


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_fuzz_hostile_flags(template, data):
    verb = data.draw(st.sampled_from(["generate", "eval", "distill"]), "verb")
    flag = data.draw(st.sampled_from(NUMERIC[verb] + ["--set"]), "flag")
    hostile = [v for v in HOSTILE if not (flag in SIZES and v == "99999999999999999999")]
    value = data.draw(st.sampled_from(hostile) | st.text(max_size=12), "value")
    if flag == "--set":
        value = f"{data.draw(st.sampled_from(SET_KEYS), 'key')}={value}"
    check_flag_example(template, verb, flag, value)


@pytest.mark.slow
def test_fuzz_tally_has_no_traceback_and_no_leftover():
    """Runs after the fuzz tests above (file order): prints the tally docs/setup.md quotes."""
    tried = TALLY["accepted"] + TALLY["refused"]
    print(f"\nbad-input fuzzer: {tried} inputs tried, {TALLY['refused']} refused with exit 2, "
          f"{TALLY['accepted']} still valid, {TALLY['traceback']} tracebacks, {TALLY['leftover']} leftovers, {TALLY['hang']} hangs")
    assert TALLY["traceback"] == 0 and TALLY["leftover"] == 0 and TALLY["hang"] == 0
