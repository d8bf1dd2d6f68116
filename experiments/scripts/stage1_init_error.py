"""Stage-1 loss of each method at its initialisation, before any training, on the real teacher.

    python experiments/scripts/stage1_init_error.py [--model smollm2] [--tokens 2048] [--set lizard:alpha_init=1.0 ...]

The MSE between each layer's output and the teacher's (the stage-1 loss, averaged over layers) on
2 x 1024 tokens of the public-domain essays, one forward per variant. A start far from the teacher
costs training tokens; this is how the Lizard alpha_init default was chosen (docs/methods.md).
"""

from __future__ import annotations

import argparse

import torch

from linearize.convert import convert
from linearize.eval.texts import essay_files
from linearize.loading import load_model, load_tokenizer

VARIANTS = {
    "lizard (alpha_init=0, the default)": ("lizard", {}),
    "lizard alpha_init=0.5": ("lizard", {"alpha_init": 0.5}),
    "lizard alpha_init=1": ("lizard", {"alpha_init": 1.0}),
    "lizard, one shared normaliser": ("lizard", {"combine": "shared"}),
    "still": ("still", {}),
    "lolcats": ("lolcats", {}),
    "liger": ("liger", {}),
}


def init_error(model_spec: str, method: str, options: dict, ids: torch.Tensor) -> torch.Tensor:
    """Per-layer stage-1 MSE of a freshly converted model."""
    model = convert(load_model(model_spec), method, **options)
    layers = [layer.self_attn for layer in model.model.layers]
    for layer in layers:
        layer.attention_transfer = True
    with torch.no_grad():
        model(ids)
    return torch.stack([layer.transfer_loss for layer in layers])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=2048, help="split into two sequences")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    text = " ".join(path.read_text() for path in essay_files())
    ids = tokenizer(text[: 100 * args.tokens], return_tensors="pt").input_ids[:, : args.tokens].view(2, -1)
    print(f"{'variant':<38} {'mean MSE':>9} {'worst layer':>12}")
    for name, (method, options) in VARIANTS.items():
        per_layer = init_error(args.model, method, options, ids)
        print(f"{name:<38} {per_layer.mean().item():>9.3f} {per_layer.max().item():>12.3f}", flush=True)


if __name__ == "__main__":
    main()
