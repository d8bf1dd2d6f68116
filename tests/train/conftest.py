import random

import pytest
from tiny_models import save_tiny_teacher


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny teacher and a small text file to distill it on."""
    root = tmp_path_factory.mktemp("distill")
    save_tiny_teacher(root / "teacher")
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "and", "then", "came", "back", "home"]
    (root / "data.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(120)) for _ in range(40)))
    return root
