"""Checkpoints saved by an earlier release load through `from_pretrained` and give the same logits."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import linearize  # noqa: F401  (registers the linearized model types with the Auto classes)
from linearize.ops.backend import use_backend

CHECKPOINTS = Path(__file__).parent / "fixtures" / "checkpoints"


@pytest.mark.parametrize("method", ["lizard", "still", "lolcats", "liger"])
def test_checkpoint_from_an_earlier_release_gives_the_same_logits(method):
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINTS / method)
    expected = torch.load(CHECKPOINTS / method / "expected.pt")
    assert model.config.linearize["method"] == method
    with torch.no_grad(), use_backend("torch"):
        logits = model(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=1e-5)
