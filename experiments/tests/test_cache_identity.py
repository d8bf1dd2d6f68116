"""experiments/serve/cache_identity.py: in float32 a chat answers the same with the prefix cache on and off."""

import torch

from experiments.serve import cache_identity


def test_float32_answers_do_not_depend_on_the_cache():
    same = cache_identity.same_answers(torch.float32, layers=2, window=16)
    assert same and all(same)
