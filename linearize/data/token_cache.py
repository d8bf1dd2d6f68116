"""On-disk cache of packed token blocks, so repeated runs don't re-tokenize."""

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np


def default_cache_dir() -> Path:
    """`blocks/` in the project's user cache ($LINEARIZE_CACHE, else ~/.cache/linearize), beside the assets."""
    from linearize.assets import cache_dir

    return cache_dir() / "blocks"


def cached_array(directory: Path, key: str, build: Callable[[], tuple[np.ndarray, dict]]) -> np.ndarray:
    """The array stored under `key`, building and storing it first if it isn't there.

    `build` returns the array and a dict of facts written beside it as JSON for people to read.
    The array comes back memory-mapped read-only, so a large dataset isn't held in RAM by every process.
    """
    path = directory / f"{key}.npy"
    if not path.exists():
        array, info = build()
        directory.mkdir(parents=True, exist_ok=True)
        # Write then rename: concurrent ranks building the same key never see a half-written file.
        tmp = directory / f"{key}.{os.getpid()}.tmp.npy"
        np.save(tmp, array)
        (directory / f"{key}.json").write_text(json.dumps(info, indent=2) + "\n")
        os.replace(tmp, path)
    return np.load(path, mmap_mode="r")
