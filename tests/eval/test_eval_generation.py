import torch

from linearize.eval.generation import greedy_generate, left_pad, rows_per_batch


def test_batched_left_padded_generation_equals_one_by_one(model, tokenizer):
    prompts = ["The whale", "Call me Ishmael. Some years ago", "Sea", "The captain walked the deck at night and"]
    batched = greedy_generate(model, tokenizer, prompts, 12, batch=4)
    alone = [greedy_generate(model, tokenizer, [p], 12, batch=1)[0] for p in prompts]
    assert batched == alone
    assert len(set(batched)) >= 3  # prompt-specific continuations, not one constant string


def test_left_pad_right_aligns_rows():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == torch.long


def test_rows_per_batch_shrinks_for_long_sequences():
    assert rows_per_batch(1024, 8, max_batch_tokens=65536) == 8
    assert rows_per_batch(32768, 8, max_batch_tokens=65536) == 2
    assert rows_per_batch(131072, 8, max_batch_tokens=65536) == 1
