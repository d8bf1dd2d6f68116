"""Seeded permutations shared by the packer and the loader."""

import numpy as np


def permutation(n: int, *seed: int) -> np.ndarray:
    """A permutation of range(n) that depends only on n and the seed parts (e.g. seed, epoch)."""
    # SeedSequence mixes the parts, so nearby (seed, epoch) pairs give unrelated orders.
    return np.random.default_rng(np.random.SeedSequence(seed)).permutation(n)
