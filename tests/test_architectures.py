"""Every supported teacher family converts, trains, decodes and saves: q/k norms (Qwen3, Gemma 3, OLMo-2),
a fused qkv (Phi-3), query scaling and logit caps (Gemma 2), sliding-window layers (Gemma), and
`layers="full"`, which linearizes the full-attention layers only."""

import pytest
import torch
from tiny_models import ARCHITECTURES, METHODS, TINY_OPTIONS, covering, perturb_new_parameters, tiny_teacher
from transformers import AutoModelForCausalLM, DynamicCache, Gemma3Config, Phi3Config

import linearize
from linearize.architectures import layer_types, layers_kept_softmax
from linearize.attention import LinearizedAttention
from linearize.cache import cache_nbytes

FAMILIES = list(ARCHITECTURES)
SLIDING_FAMILIES = ["gemma2", "gemma3_text"]


def converted(arch, method="lizard", **options):
    model = linearize.convert(tiny_teacher(arch), method, **{**TINY_OPTIONS[method], **options})
    perturb_new_parameters(model)
    return model


def ids_and_padding(length=14, pad=5):
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = 0, 0
    return ids, mask


def assert_pieces_equal_whole(model, ids):
    """A prefill of 9 tokens, one step, then the rest, on one cache: the logits of the whole sequence."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
        pieces = [model(ids[:, a:b], past_key_values=cache).logits for a, b in [(0, 9), (9, 10), (10, ids.shape[1])]]
    torch.testing.assert_close(torch.cat(pieces, 1), whole, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("padded", [False, True])
def test_in_stage_one_the_student_is_the_teacher(arch, padded):
    """With attention transfer on, each layer hands on the teacher's own attention output, computed
    from the student's q, k and v: the student's logits are then the teacher's, which holds only if
    q and k are formed and scaled as the teacher forms them (norms, fused qkv, caps, sliding masks:
    14 tokens cross Gemma's window of 6)."""
    teacher = tiny_teacher(arch)
    ids, mask = ids_and_padding()
    mask = mask if padded else None
    with torch.no_grad():
        expected = teacher(ids, attention_mask=mask).logits
        student = converted(arch, "still")
        for module in student.modules():
            if isinstance(module, LinearizedAttention):
                module.attention_transfer = True
        got = student(ids, attention_mask=mask).logits
    rows = slice(None) if mask is None else mask.bool()
    torch.testing.assert_close(got[rows], expected[rows], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch,method", covering(FAMILIES, METHODS))
def test_prefill_then_decode_and_left_padding(arch, method):
    model = converted(arch, method)
    assert_pieces_equal_whole(model, torch.randint(3, 128, (2, 23), generator=torch.Generator().manual_seed(0)))

    padded, mask = ids_and_padding()
    with torch.no_grad():
        batch = model.generate(padded, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        alone = model.generate(padded[1:, 5:], max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(batch[1, 14:], alone[0, 9:])


@pytest.mark.parametrize("arch", FAMILIES)
def test_saves_and_loads_as_its_own_class(arch, tmp_path):
    model = converted(arch)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model) and reloaded.config.model_type == f"linearized_{arch}"
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_phi3_fused_qkv_becomes_three_projections_with_its_rows():
    teacher = tiny_teacher("phi3")
    fused = teacher.model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    attention = linearize.convert(teacher, "lizard", **TINY_OPTIONS["lizard"]).model.layers[0].self_attn
    q, k, v = attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight
    assert (q.shape[0], k.shape[0], v.shape[0]) == (64, 32, 32)
    assert torch.equal(torch.cat([q, k, v]), fused)
    assert not hasattr(attention, "qkv_proj")


@pytest.mark.parametrize("arch", SLIDING_FAMILIES)
@pytest.mark.parametrize("method", ["lizard", "still"])
def test_full_layers_only_keeps_the_sliding_layers_and_a_constant_cache(arch, method):
    model = converted(arch, method, layers="full")
    kinds = [isinstance(layer.self_attn, LinearizedAttention) for layer in model.model.layers]
    assert kinds == [t == "full_attention" for t in layer_types(model.config)] == [False, False, True]
    assert model.config.linearize["softmax_layers"] == [0, 1] and model.config.linearize["layers"] == "full"

    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    cache = DynamicCache(config=model.config)
    sizes, steps = [], []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
            sizes.append(cache_nbytes(cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=0)
    # The sliding layers keep their window of keys (6 - 1 after a step), the linear layer its state.
    assert len(set(sizes[12:])) == 1

    padded, mask = ids_and_padding(length=16, pad=4)
    with torch.no_grad():
        batch = model.generate(padded, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        alone = model.generate(padded[1:, 4:], max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(batch[1, 16:], alone[0, 12:])


@pytest.mark.parametrize("arch", SLIDING_FAMILIES)
def test_a_hybrid_with_a_softmax_sliding_layer_behind_linear_ones_decodes_in_chunks(arch):
    """A softmax sliding layer after linearized ones: HF sizes the sliding mask off the first sliding
    cache layer, a linearized one, which must answer as HF's own sliding layer would."""
    model = converted(arch, "lizard", softmax_layers=[1])
    assert_pieces_equal_whole(model, torch.randint(3, 128, (2, 26), generator=torch.Generator().manual_seed(2)))


def test_full_layers_of_a_model_without_sliding_layers_are_all_its_layers():
    assert layers_kept_softmax(tiny_teacher("llama").config, "full") == []
    model = converted("qwen3", layers="full")
    assert all(isinstance(layer.self_attn, LinearizedAttention) for layer in model.model.layers)


def test_unsupported_models_get_one_line_reasons():
    with pytest.raises(linearize.UnsupportedModelError, match=r"cannot linearize model type 'gpt2'; supported: .*gemma3_text"):
        linearize.convert(type("M", (), {"config": type("C", (), {"model_type": "gpt2"})()})(), "lizard")
    multimodal = type("M", (), {"config": Gemma3Config()})()
    with pytest.raises(linearize.UnsupportedModelError, match="load its text model"):
        linearize.convert(multimodal, "lizard")
    partial = type("M", (), {"config": Phi3Config(partial_rotary_factor=0.5)})()
    with pytest.raises(linearize.UnsupportedModelError, match="partial_rotary_factor=0.5"):
        linearize.convert(partial, "lizard")
    with pytest.raises(linearize.UnsupportedModelError, match="layers must be one of all, full"):
        linearize.convert(tiny_teacher(), "lizard", layers="sliding")


def test_convert_and_distill_take_layers_full_on_the_command_line(tmp_path, capsys):
    from tiny_models import save_tiny_teacher

    from linearize.cli import main
    from linearize.loading import load_model

    teacher = save_tiny_teacher(tmp_path / "teacher", arch="gemma3_text")
    out = tmp_path / "student"
    assert main(["convert", "--model", str(teacher), "--method", "still", "--layers", "full", "--out", str(out),
                 *[f"--set={k}={v}" for k, v in TINY_OPTIONS["still"].items()]]) == 0
    model = load_model(out)
    assert model.config.linearize["softmax_layers"] == [0, 1]
    assert [type(layer.self_attn).__name__ for layer in model.model.layers] == [
        "Gemma3Attention", "Gemma3Attention", "StillAttention"]

    (tmp_path / "data.txt").write_text("\n".join(" ".join(["the cat sat on the mat"] * 20) for _ in range(40)))
    run = tmp_path / "run"
    assert main(["distill", "--model", str(teacher), "--method", "lizard", "--layers", "full", "--out", str(run),
                 "--data", str(tmp_path / "data.txt"), "--max-tokens", "256", "--seq-len", "32", "--batch", "4",
                 "--set", "window=8", "--device", "cpu"]) == 0
    distilled = load_model(run)
    assert distilled.config.linearize["layers"] == "full" and distilled.config.linearize["softmax_layers"] == [0, 1]

    # Every layer of a Mistral with a window slides: --layers full would leave none to linearize.
    mistral = save_tiny_teacher(tmp_path / "mistral", arch="mistral")
    capsys.readouterr()
    assert main(["convert", "--model", str(mistral), "--method", "lizard", "--layers", "full",
                 "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "every one of the model's 2 layers is a sliding-window layer" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "none").exists()
