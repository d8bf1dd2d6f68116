"""A results file of `linearize eval` on disk: FILE.json holds the scores and the provenance, and
FILE.samples.jsonl.gz beside it every task's per-sample records (prompts' answers, predictions, scores).

The records are most of a run's bytes and are read only to look into single answers, so they are kept
apart and compressed: the JSON stays small enough to read, diff and commit. It has a line per top-level
key and per member of each top-level object (a task, a provenance field), each compact on its line
(`linearize.cli_args.compact_json`). The gzip stream has no timestamp, so the same records give the same
bytes. A results file written with the records inline
(no "samples_file" key) reads the same way.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from linearize.cli_args import compact_json, write_text_atomic

# The JSON's top-level key naming the records file beside it (a bare file name, so the pair can move).
SAMPLES_KEY = "samples_file"


def samples_path(out: str | Path) -> Path:
    """FILE.samples.jsonl.gz beside the results file FILE.json."""
    out = Path(out)
    return out.with_name(f"{out.stem}.samples.jsonl.gz")


def split_samples(results: dict) -> tuple[dict, dict[str, list]]:
    """(the results without any task's "samples", {task: its samples}); `results` is not changed."""
    samples = {name: result["samples"] for name, result in results["tasks"].items()
               if isinstance(result, dict) and "samples" in result}
    tasks = {name: ({k: v for k, v in result.items() if k != "samples"} if name in samples else result)
             for name, result in results["tasks"].items()}
    return {**results, "tasks": tasks}, samples


def join_samples(scores: dict, samples: dict[str, list]) -> dict:
    """The results of `split_samples` whole again: each task's "samples" back in it."""
    tasks = {name: (result | {"samples": samples[name]} if name in samples else result)
             for name, result in scores["tasks"].items()}
    return {k: v for k, v in scores.items() if k != SAMPLES_KEY} | {"tasks": tasks}


def samples_bytes(samples: dict[str, list]) -> bytes:
    """The records file's bytes: a line {"task": NAME, "samples": [...]} per task, gzipped without a timestamp."""
    lines = "".join(json.dumps({"task": name, "samples": records}, default=str) + "\n"
                    for name, records in samples.items())
    return gzip.compress(lines.encode("utf-8"), compresslevel=9, mtime=0)


def read_samples(path: Path) -> dict[str, list]:
    """{task: samples} of a records file written by `write_results`."""
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return {entry["task"]: entry["samples"] for entry in map(json.loads, filter(str.strip, lines))}


def _write_bytes_atomic(path: Path, data: bytes) -> Path:
    # As write_text_atomic: a reader finds the old file or the new one, never half of one.
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_results(results: dict, out: str | Path) -> Path:
    """The scores as JSON at `out` and the per-sample records beside it, each replaced atomically. Both
    are serialized before either is written, and the records go first, so the JSON never names records
    that are not there yet; a JSON without records takes any stale records file away with it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scores, samples = split_samples(results)
    records = samples_path(out)
    if samples:
        scores = {**scores, SAMPLES_KEY: records.name}
    data = samples_bytes(samples) if samples else None
    text = compact_json(scores, default=str) + "\n"
    if data is not None:
        _write_bytes_atomic(records, data)
    write_text_atomic(out, text)
    if data is None:
        records.unlink(missing_ok=True)
    return out


def read_results(path: str | Path, *, samples: bool = True) -> dict:
    """The results file at `path`, each task's "samples" back in it from the records file it names
    (with `samples=False`, the scores alone, without reading the records). Raises OSError and
    ValueError (json.JSONDecodeError, a gzip error) as reading the files does."""
    path = Path(path)
    scores = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(scores, dict) or SAMPLES_KEY not in scores or not isinstance(scores.get("tasks"), dict):
        return scores
    if not samples:
        return {k: v for k, v in scores.items() if k != SAMPLES_KEY}
    try:
        return join_samples(scores, read_samples(path.with_name(scores[SAMPLES_KEY])))
    except (EOFError, gzip.BadGzipFile) as e:
        raise ValueError(f"{scores[SAMPLES_KEY]}: {e}") from e
