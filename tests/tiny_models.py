
import torch

from linearize.architectures import ARCHITECTURES as SUPPORTED

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 4096, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

ARCHITECTURES = {name: (arch.config_class, arch.model_class) for name, arch in SUPPORTED.items()}
# What each family needs beyond TINY to be small and to show its traits in short sequences: Gemma's
# sliding layers (a window of 6 beside a full layer), Gemma 2's logit cap (small enough to bind on tiny
# logits; HF's SDPA attention ignores it, its eager one applies it), explicit head sizes where the
# family's default is 256.
_SLIDING = {"num_hidden_layers": 3, "sliding_window": 6,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}
ARCHITECTURE_OVERRIDES = {
    "qwen3": {"head_dim": 16},
    "gemma2": {**_SLIDING, "head_dim": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 0.02,
               "attn_implementation": "eager"},
    "gemma3_text": {**_SLIDING, "head_dim": 16, "query_pre_attn_scalar": 24},
    "olmo2": {},
    "phi3": {},
}

# Small windows/chunks so that short test sequences cross several of them.
TINY_OPTIONS = {
    "lizard": {"window": 8, "num_sinks": 2},
    "still": {"window": 8, "budget": 14, "chunk_size": 4, "max_chunks": 2},
    "lolcats": {"window": 8},
    "liger": {"window": 8},
}
METHODS = list(TINY_OPTIONS)


def tiny_teacher(arch: str = "llama", seed: int = 0, **overrides):
    config_class, model_class = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    return model_class(config_class(**{**TINY, **ARCHITECTURE_OVERRIDES.get(arch, {}), **overrides})).eval()


def perturb_new_parameters(model, scale: float = 0.3, seed: int = 1):
    """Move the new modules away from their init so that every term of the output matters."""
    from linearize.attention import LinearizedAttention

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LinearizedAttention):
                for p in module.new_parameters():
                    p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))




def tiny_student(method: str = "lizard", arch: str = "llama", **options):
    """A tiny teacher of `arch` converted by `method` with TINY_OPTIONS (and `options` over them), its new
    parameters moved off their init."""
    import linearize

    model = linearize.convert(tiny_teacher(arch), method, **{**TINY_OPTIONS[method], **options})
    perturb_new_parameters(model)
    return model


def tiny_tokenizer():
    """A character-level tokenizer that fits the tiny models' 128-token vocabulary, built offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in range(32, 127):  # ids 4..98, one per printable ASCII character
        vocab[chr(c)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def save_tiny_teacher(path, arch="llama"):
    tiny_teacher(arch).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def covering(archs: list[str], methods: list[str]) -> list:
    """(arch, method) pairs for a parametrize: every pair, the slow mark on all but a few that take each
    family and each method at least once (`make test` runs those; `make test-all` every pair)."""
    import pytest

    fast = {(arch, methods[i % len(methods)]) for i, arch in enumerate(archs)}
    return [pytest.param(arch, method, marks=() if (arch, method) in fast else pytest.mark.slow)
            for arch in archs for method in methods]


def assert_left_padded_generates_like_unpadded(model, new_tokens: int = 8):
    """Greedy generation of a left-padded row equals that of the same prompt alone, without padding."""
    ids = torch.randint(3, 128, (2, 14), generator=torch.Generator().manual_seed(0))
    padded, mask = ids.clone(), torch.ones_like(ids)
    padded[1, :5], mask[1, :5] = 0, 0
    with torch.no_grad():
        # min_new_tokens: an early end-of-sequence would pad the batch's row but end the lone one.
        batch = model.generate(padded, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False)
        alone = model.generate(ids[1:, 5:], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(batch[1, 14:], alone[0, 9:])


def parameters_that_learn_alone(model, new_parameters) -> set[int]:
    """The ids of the parameters a loss reaches when only `new_parameters` train."""
    new = {id(p) for p in new_parameters}
    for p in model.parameters():
        p.requires_grad_(id(p) in new)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    return {id(p) for p in model.parameters() if p.grad is not None and p.grad.abs().sum() > 0}
