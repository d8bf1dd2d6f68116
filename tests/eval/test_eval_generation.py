import torch

from linearize.eval.generation import greedy_generate, left_pad, rows_per_batch


def test_batched_left_padded_generation_equals_one_by_one(model, tokenizer):
    prompts = ["The whale", "Call me Ishmael. Some years ago", "Sea", "The captain walked the deck at night and"]
    batched = greedy_generate(model, tokenizer, prompts, 12, batch=4)
    alone = [greedy_generate(model, tokenizer, [p], 12, batch=1)[0] for p in prompts]
    assert batched == alone
    assert len(set(batched)) >= 3  # prompt-specific continuations, not one constant string
    assert greedy_generate(model, tokenizer, [], 12) == []


def test_left_pad_right_aligns_rows():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == torch.long


def test_rows_per_batch_shrinks_for_long_sequences():
    assert rows_per_batch(1024, 8, max_batch_tokens=65536) == 8
    assert rows_per_batch(32768, 8, max_batch_tokens=65536) == 2
    assert rows_per_batch(131072, 8, max_batch_tokens=65536) == 1


def test_softmax_models_prefill_long_prompts_in_chunks_with_the_same_text(tokenizer, monkeypatch):
    """A teacher (Llama, and a Gemma 3 with sliding layers of 6 tokens) generates through HF's chunked
    prefill once a batch's prompts pass the prefill budget: the same greedy text as one call."""
    from tiny_models import tiny_teacher

    from linearize import decode

    prompts = ["The whale swam far", "Call me Ishmael. Some years ago, never mind", "Sea"]
    for arch in ("llama", "gemma3_text"):
        model = tiny_teacher(arch, vocab_size=len(tokenizer))
        whole = greedy_generate(model, tokenizer, prompts, 10, batch=3, static=False)
        monkeypatch.setattr(decode, "PREFILL_TOKENS", 24)  # 8 tokens a call for 3 rows
        chunked = greedy_generate(model, tokenizer, prompts, 10, batch=3, static=False)
        monkeypatch.undo()
        assert chunked == whole and any(whole), arch
