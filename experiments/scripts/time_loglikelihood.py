"""lm-eval's log-likelihood requests, HellaSwag-shaped, scored by lm-eval's own per-request loop and by
`linearize.eval.continuations` (what `linearize eval` runs), on a random model of a known shape:
requests a second for each, and how far their answers are apart.

    python experiments/scripts/time_loglikelihood.py [--shape smollm2] [--method lizard] [--contexts 2500]

Each context (60 to 100 tokens) has four endings (10 to 30 tokens), as HellaSwag's 10,042 questions
make 40,168 requests. Both paths get the same batches' budget (`--batch` rows, 65,536 tokens).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from lm_eval.models.huggingface import HFLM
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from linearize.bench.shapes import random_model
from linearize.convert import convert
from linearize.eval.harness import budgeted_lm, building_no_cache


def hellaswag_shaped(contexts: int, vocab: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    requests = []
    for i in range(contexts):
        context = [rng.randrange(3, vocab) for _ in range(rng.randrange(60, 101))]
        for ending in range(4):
            requests.append(((str(i), str(ending)), context, [rng.randrange(3, vocab) for _ in range(rng.randrange(10, 31))]))
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2")
    parser.add_argument("--method", default=None, help="convert to this method first (random weights), e.g. lizard")
    parser.add_argument("--contexts", type=int, default=2500)
    parser.add_argument("--batch", type=int, default=32, help="rows a forward (the results rows' eval batch)")
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    model = random_model(args.shape, device=device, dtype=torch.bfloat16 if device == "cuda" else None, **overrides)
    if args.method:
        model = convert(model, args.method)
    model.eval()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                        unk_token="<unk>", pad_token="<unk>", eos_token="<unk>")
    requests = hellaswag_shaped(args.contexts, model.config.vocab_size)
    paths = {"lm-eval's loop": HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch, device=device),
             "linearize": budgeted_lm(model, tokenizer, args.batch)}
    answers = {}
    with building_no_cache(model):
        for name, lm in paths.items():
            lm._loglikelihood_tokens(requests[:64], disable_tqdm=True)  # kernels compiled, memory pooled
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            answers[name] = lm._loglikelihood_tokens(requests, disable_tqdm=True)
            seconds = time.perf_counter() - start
            print(f"{name:>15}: {len(requests) / seconds:8.0f} requests/s ({seconds:.1f} s for {len(requests)})")
    (ref, ours) = answers.values()
    gap = max(abs(a[0] - b[0]) for a, b in zip(ref, ours, strict=True))
    same = sum(a[1] == b[1] for a, b in zip(ref, ours, strict=True))
    print(f"{args.shape} {args.method or 'softmax'} on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}: "
          f"largest log-likelihood gap {gap:.2e}, greedy flags equal {same}/{len(requests)}")


if __name__ == "__main__":
    main()
