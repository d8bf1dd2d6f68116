"""Long public-domain texts used by the evals: the held-out perplexity text and essay haystacks."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

HELD_OUT = "moby"  # Moby-Dick is kept out of the training mix, so perplexity on it is held out


def texts_dir() -> Path:
    from linearize.assets import public_domain_texts

    return Path(public_domain_texts())


def default_ppl_text() -> Path:
    """The Moby-Dick .txt among the public-domain texts."""
    folder = texts_dir()
    matches = sorted(p for p in folder.glob("*.txt") if HELD_OUT in p.name.lower())
    if not matches:
        raise ValueError(f"No Moby-Dick .txt file in {folder}; pass a text file for perplexity explicitly.")
    return matches[0]


def essay_files() -> list[Path]:
    """Every public-domain text except the held-out one, for RULER-style essay haystacks."""
    return sorted(p for p in texts_dir().rglob("*.txt") if HELD_OUT not in p.name.lower())


@lru_cache(maxsize=4)
def sentences(paths: tuple[str, ...]) -> tuple[str, ...]:
    """The sentences of the given files, whitespace collapsed, in file order."""
    text = " ".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in paths)
    parts = re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", text))
    return tuple(s for s in (p.strip() for p in parts) if s)


def essay_sentences(path: str | Path | None = None) -> tuple[str, ...]:
    """Haystack sentences from `path`, or from all non-held-out public-domain texts."""
    paths = [Path(path)] if path is not None else essay_files()
    if not paths:
        raise ValueError("No essay text found for the essay haystack; pass a .txt file explicitly.")
    return sentences(tuple(str(p) for p in paths))
