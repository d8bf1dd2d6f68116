"""Turn a DATA spec into documents (plain strings).

A spec is one of:
  - `default`: the offline default mix (see default_mix.py);
  - a local `.txt` file (one document), `.jsonl` file (one record a line) or `.json` file (a list of records);
  - a local folder: a `datasets.save_to_disk` directory, or else every .txt/.json/.jsonl file below it;
  - a Hugging Face hub dataset name such as `yahma/alpaca-cleaned` (its train split; needs the network).
A record is used through its `text` field, or else as an Alpaca record (`instruction`, `input`, `output`).
"""

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from linearize.cli_args import first_line
from linearize.data.alpaca import format_example
from linearize.data.errors import DataError
from linearize.hub import hub_reachable

FILE_SUFFIXES = (".txt", ".jsonl", ".json")
HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")
ALPACA_FIELDS = ("instruction", "output")
BATCH = 1000  # rows read from an arrow dataset at a time


def load_documents(spec: str | Path) -> Iterator[str]:
    """The documents of `spec`, in a fixed order. Whitespace-only documents are skipped.

    Raises FileNotFoundError for a missing local path, and DataError for data in a form it cannot read.
    The spec is resolved before this returns, so a bad path fails here rather than at the first document.
    """
    spec = str(spec)
    if spec == "default":
        from linearize.data import default_mix

        return default_mix.documents()
    path = Path(spec).expanduser()
    if path.exists():
        return _non_empty(_local_documents(path))
    if _is_hub_name(spec):
        return _non_empty(_dataset_documents(_load_hub(spec), spec))
    raise FileNotFoundError(f"Data path not found: {path}")


def data_fingerprint(spec: str | Path) -> str:
    """A short hash that changes when the data behind `spec` changes (used to key the token cache).

    Local data is keyed by file names, sizes and modification times, so an edited file is re-tokenized.
    Hub datasets are keyed by name only: clear the cache to pick up a new revision.
    """
    spec = str(spec)
    if spec == "default":
        from linearize.data import default_mix

        return default_mix.fingerprint()
    path = Path(spec).expanduser()
    if not path.exists():
        if _is_hub_name(spec):
            return _hash(["hub", spec])
        raise FileNotFoundError(f"Data path not found: {path}")
    root = path.resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    return _hash([str(root)] + [_file_stamp(f, root.parent) for f in files])


def _hash(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _file_stamp(f: Path, base: Path) -> str:
    stat = f.stat()
    return f"{f.relative_to(base).as_posix()}:{stat.st_size}:{stat.st_mtime_ns}"


def _is_hub_name(spec: str) -> bool:
    # `owner/name` or `name`; anything that looks like a file or a relative path is treated as a local path.
    return bool(HUB_NAME.fullmatch(spec)) and not spec.startswith(".") and not spec.endswith(FILE_SUFFIXES)


def _non_empty(documents: Iterable[str]) -> Iterator[str]:
    return (doc for doc in documents if doc.strip())


def _local_documents(path: Path) -> Iterator[str]:
    if path.is_dir() and _is_saved_dataset(path):
        return _dataset_documents(_load_saved(path), str(path))
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix in FILE_SUFFIXES),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise DataError(f"{path} holds no .txt, .json or .jsonl files and is not a datasets.save_to_disk "
                            "directory.")
        return (doc for f in files for doc in _file_documents(f))
    if path.suffix not in FILE_SUFFIXES:
        raise DataError(f"Unsupported data file {path}: expected .txt, .jsonl or .json, a folder of them, "
                        "or a datasets.save_to_disk directory.")
    return _file_documents(path)


def _file_documents(path: Path) -> Iterator[str]:
    try:
        yield from _decoded_documents(path)
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start} cannot be decoded): is it a binary file?") from None


def _decoded_documents(path: Path) -> Iterator[str]:
    if path.suffix == ".txt":
        yield path.read_text(encoding="utf-8")
    elif path.suffix == ".json":
        records = _parse_json(path.read_text(encoding="utf-8"), str(path))
        if not isinstance(records, list):
            raise DataError(f"{path}: expected a JSON list of records; use .jsonl for one record a line.")
        for i, record in enumerate(records):
            yield _record_text(_as_record(record, f"{path}[{i}]"), f"{path}[{i}]")
    else:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    where = f"{path}:{lineno}"
                    yield _record_text(_as_record(_parse_json(line, where), where), where)


def _parse_json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg}).") from e


def _as_record(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON object with a 'text' field or Alpaca fields.")
    return value


def _record_text(record: dict, where: str) -> str:
    """The training text of one record: its `text` field, or its Alpaca prompt + output."""
    if "text" in record and isinstance(record["text"], str | None):
        return record["text"] or ""
    if all(isinstance(record.get(field), str) for field in ALPACA_FIELDS):
        return format_example(record)
    raise DataError(f"{where}: record has neither a 'text' field nor Alpaca 'instruction'/'output' fields "
                    f"(found {sorted(record)}).")


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _load_saved(path: Path):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
        # Arrow trusts the offsets stored in the file: a corrupt one is read as it stands, past the end
        # of its buffer, and can crash the process. A full validation checks them all first.
        for split in loaded.values() if isinstance(loaded, datasets.DatasetDict) else [loaded]:
            split.data.table.validate(full=True)
    except Exception as e:  # pyarrow's errors for a truncated or foreign .arrow file, a bad state.json, ...
        reason = first_line(e)
        raise DataError(f"{path} is not a readable datasets.save_to_disk folder ({reason}).") from e
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{path} is a DatasetDict without a 'train' split (splits: {sorted(loaded)}).")
        return loaded["train"]
    return loaded


def _load_hub(name: str):
    import datasets
    import huggingface_hub

    local = "pass a local .jsonl/.json/.txt file, a folder of them, or a datasets.save_to_disk directory"
    # Without this check, an offline machine spends half a minute in the hub client's retries before failing.
    if not huggingface_hub.constants.HF_HUB_OFFLINE and not hub_reachable():
        raise DataError(f"'{name}' is not a local path, and the Hugging Face hub cannot be reached: {local} "
                        "(or set HF_HUB_OFFLINE=1 to use a copy already in the Hugging Face cache).")
    try:
        return datasets.load_dataset(name, split="train")
    except Exception as e:  # unknown name, gated, no cached copy: all end the same way for the user
        raise DataError(f"Could not load '{name}' from the Hugging Face hub ({type(e).__name__}: {e}). It is not "
                        f"a local path either: {local}.") from e


def _dataset_documents(dataset, where: str) -> Iterator[str]:
    columns = set(dataset.column_names)
    if "text" in columns:
        columns_used = ["text"]
    elif set(ALPACA_FIELDS) <= columns:
        columns_used = [c for c in ("instruction", "input", "output") if c in columns]
    else:
        raise DataError(f"{where} has no usable column: need 'text' or Alpaca 'instruction'/'output' "
                        f"(found {sorted(columns)}).")
    return _dataset_rows(dataset.select_columns(columns_used), where)


def _dataset_rows(dataset, where: str) -> Iterator[str]:
    for batch in dataset.iter(batch_size=BATCH):
        for values in zip(*batch.values()):
            yield _record_text(dict(zip(batch, values)), where)
