import math
from itertools import pairwise

import pytest
import torch
from tiny_models import TINY_OPTIONS, perturb_new_parameters, tiny_teacher

import linearize
from linearize.eval.perplexity import log_buckets, perplexity, text_tokens, token_nll


def hand_nll(model, windows: torch.Tensor) -> torch.Tensor:
    """Per-token NLL straight from full-precision logits, one window at a time."""
    rows = []
    with torch.no_grad():
        for window in windows:
            logp = model(window[None]).logits[0].double().log_softmax(-1)
            rows.append(-logp[:-1].gather(1, window[1:, None])[:, 0])
    return torch.stack(rows)


def test_ppl_is_exp_of_mean_nll_by_hand(model, tokenizer, ppl_text):
    result = perplexity(model, tokenizer, [128, 256], text=ppl_text, max_tokens=1024, batch=3, buckets=8)
    tokens = text_tokens(tokenizer, ppl_text)
    for row in result["by_length"]:
        length = row["length"]
        windows = tokens[: 1024 // length * length].view(-1, length)
        nll = hand_nll(model, windows)
        assert row["windows"] == len(windows)
        assert row["nll"] == pytest.approx(nll.mean().item(), rel=1e-5)
        assert row["ppl"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)
    # The curve is the per-position mean over the longest windows, bucketed.
    nll = hand_nll(model, tokens[:1024].view(-1, 256))
    curve = result["loss_by_position"]
    assert curve["length"] == 256 and curve["windows"] == 4
    for bucket in curve["buckets"]:
        expected = nll[:, bucket["start"] - 1 : bucket["end"] - 1].mean().item()
        assert bucket["loss"] == pytest.approx(expected, rel=1e-5)


def test_same_result_for_any_batch_size(model, tokenizer, ppl_text):
    one = perplexity(model, tokenizer, [64], text=ppl_text, max_tokens=640, batch=1)
    many = perplexity(model, tokenizer, [64], text=ppl_text, max_tokens=640, batch=7)
    assert one["by_length"][0]["ppl"] == pytest.approx(many["by_length"][0]["ppl"], rel=1e-5)


def test_limit_caps_windows_per_length(model, tokenizer, ppl_text):
    result = perplexity(model, tokenizer, [64, 128], text=ppl_text, max_tokens=2048, limit=3)
    assert [r["windows"] for r in result["by_length"]] == [3, 3]


def test_text_shorter_than_the_longest_length_is_an_error(model, tokenizer, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Call me Ishmael.")
    with pytest.raises(ValueError, match="fewer than the context length 64"):
        perplexity(model, tokenizer, [64], text=short)


def test_log_buckets_cover_every_position_once():
    for length, count in [(256, 8), (32768, 48), (10, 48)]:
        buckets = log_buckets(length, count)
        assert buckets[0][0] == 1 and buckets[-1][1] == length
        assert all(a[1] == b[0] for a, b in pairwise(buckets))
        assert all(lo < hi for lo, hi in buckets)
        assert len(buckets) <= count


def test_the_head_over_slices_that_straddle_rows_gives_each_tokens_nll(model, tokenizer, ppl_text, monkeypatch):
    """The output head runs over LOSS_TOKENS hidden states at a time, across rows: slices of 37 cut
    windows of 64 mid-row."""
    from linearize.eval import perplexity as module

    monkeypatch.setattr(module, "LOSS_TOKENS", 37)
    windows = text_tokens(tokenizer, ppl_text)[: 5 * 64].view(5, 64)
    torch.testing.assert_close(module.token_nll(model, windows).double(), hand_nll(model, windows), rtol=1e-5,
                               atol=1e-5)


def test_a_tokenizer_that_starts_texts_with_bos_starts_every_window_with_it(model, tokenizer, ppl_text):
    """Gemma's tokenizer puts <bos> before every text, and the model expects it at position 0: each
    window is <bos> and L - 1 tokens of text, scored on its positions 2..L as any window."""
    import copy

    from tokenizers import processors

    tokenizer = copy.deepcopy(tokenizer)  # the fixture is shared
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    result = perplexity(model, tokenizer, [64], text=ppl_text, max_tokens=630, batch=4)
    text = text_tokens(tokenizer, ppl_text)
    assert text[0] != bos
    windows = torch.cat([torch.full((10, 1), bos), text[:630].view(10, 63)], 1)
    row = result["by_length"][0]
    assert row["windows"] == 10
    assert row["nll"] == pytest.approx(hand_nll(model, windows).mean().item(), rel=1e-5)


@pytest.mark.parametrize(("arch", "method", "layers"), [
    ("llama", None, None), ("gemma3_text", None, None), ("gemma3_text", "lizard", "all"),
    ("gemma3_text", "lizard", "full"), ("gemma3_text", "still", "full"), ("llama", "still", "all"),
    ("llama", "lolcats", "all"), ("llama", "liger", "all"),
])
def test_a_window_longer_than_one_call_scores_as_in_one_call(arch, method, layers):
    # Windows past `call_length` go through the cache in pieces, which bounds the masks one call
    # builds; the loss of every token must be the one-call loss, sliding layers and linear states alike.
    model = tiny_teacher(arch)
    if method is not None:
        linearize.convert(model, method, layers=layers, **TINY_OPTIONS[method])
        perturb_new_parameters(model)
    windows = torch.randint(4, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    whole = token_nll(model, windows, call_length=40)
    for call_length in (7, 16):
        assert torch.allclose(token_nll(model, windows, call_length=call_length), whole, atol=1e-4, rtol=1e-4)
