import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_assets import gemma3_npm_tarball
from transformers import LlamaConfig, LlamaForCausalLM

from linearize import loading
from linearize.assets import fetch, registries
from linearize.loading import ModelNotFoundError, ModelSpecError, load_model, load_tokenizer, resolve_spec

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


@pytest.fixture
def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


@pytest.fixture
def tiny_dir(tiny_llama, tmp_path):
    tiny_llama.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


@pytest.fixture
def tiny_gguf(tiny_llama, tmp_path):
    path = tmp_path / "gguf" / "tiny.gguf"
    path.parent.mkdir()
    write_llama_gguf(tiny_llama, path)
    return path


def write_llama_gguf(model: LlamaForCausalLM, path) -> None:
    """An F32 GGUF of `model`, laid out as llama.cpp's converter does, with a small byte-level BPE vocabulary."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)

    # Byte-level BPE: printable ASCII stands for itself and "Ġ" for a space.
    tokens = ["<unk>", "<s>", "</s>", "Ġ"] + [chr(b) for b in range(33, 127)] + ["he", "ll"]
    tokens += [f"<extra_{i}>" for i in range(cfg.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(["h e", "l l"])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{gg}.weight" for hf, gg in layer_parts.items()})
    for name, tensor in model.state_dict().items():
        array = tensor.numpy()
        # llama.cpp interleaves the rotary halves of q and k; transformers undoes it on load.
        if "q_proj" in name:
            array = _permute_rotary(array, cfg.num_attention_heads)
        if "k_proj" in name:
            array = _permute_rotary(array, cfg.num_key_value_heads)
        writer.add_tensor(names[name], np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _permute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_hf_dir_gives_identical_logits(tiny_llama, tiny_dir):
    ids = torch.randint(0, TINY["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(1))
    for spec in (tiny_dir, str(tiny_dir)):
        model = load_model(spec)
        assert not model.training
        assert model.dtype == torch.float32
        assert torch.equal(_logits(model, ids), _logits(tiny_llama, ids))


def test_gguf_file_gives_identical_logits(tiny_llama, tiny_gguf):
    ids = torch.randint(0, TINY["vocab_size"], (1, 23), generator=torch.Generator().manual_seed(2))
    model = load_model(tiny_gguf)
    assert model.config.num_key_value_heads == TINY["num_key_value_heads"]
    assert torch.equal(_logits(model, ids), _logits(tiny_llama, ids))


def test_smollm2_alias_is_a_dense_copy_made_once(tiny_llama, tiny_gguf, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fetch, "smollm2_gguf", lambda: tiny_gguf)
    ids = torch.randint(0, TINY["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_logits(load_model("smollm2"), ids), _logits(tiny_llama, ids))
    assert resolve_spec("smollm2") == ("dir", tmp_path / "cache" / "smollm2" / "hf-float32")
    assert load_tokenizer("smollm2").eos_token == "</s>"
    monkeypatch.setattr(fetch, "smollm2_gguf", lambda: pytest.fail("the GGUF was converted twice"))
    assert load_model("smollm2").config.num_hidden_layers == TINY["num_hidden_layers"]


def test_gemma3_alias_is_a_bfloat16_dense_copy_with_the_npm_tokenizer(tiny_gguf, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fetch, "gemma3_gguf", lambda: tiny_gguf)
    tarball = gemma3_npm_tarball(tmp_path / "tokenizer.tgz")
    monkeypatch.setattr(registries, "npm_tarball", lambda package, dest_dir: tarball)
    assert resolve_spec("gemma3") == ("dir", tmp_path / "cache" / "gemma3" / "hf-bfloat16")
    model = load_model("gemma3", dtype="auto")
    assert model.dtype == torch.bfloat16
    assert model.generation_config.eos_token_id == [1, 4]  # <eos>, <end_of_turn>
    ids = torch.randint(0, TINY["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(4))
    rounded = load_model(tiny_gguf)  # the GGUF's config too: its eps is a float32
    with torch.no_grad():
        for weight in rounded.parameters():  # the weights only: RoPE's frequencies are computed on load
            weight.copy_(weight.to(torch.bfloat16))
    assert torch.equal(_logits(load_model("gemma3"), ids), _logits(rounded, ids))
    tokenizer = load_tokenizer("gemma3")
    assert tokenizer("capital").input_ids == [tokenizer.bos_token_id, 7]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<eos>", "<pad>")
    monkeypatch.setattr(fetch, "gemma3_gguf", lambda: pytest.fail("the GGUF was converted twice"))
    assert load_model("gemma3").config.num_hidden_layers == TINY["num_hidden_layers"]


def test_dtype_and_device(tiny_dir):
    assert load_model(tiny_dir, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert load_model(tiny_dir, dtype="bfloat16", device="cpu").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(tiny_dir, dtype="float3")


def test_gguf_tokenizer_round_trips_and_has_the_files_special_tokens(tiny_gguf):
    tokenizer = load_tokenizer(tiny_gguf)
    text = "hello world! (x+y)*2 = {z}"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids("he") in ids
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "</s>")


def test_hf_dir_tokenizer(tiny_gguf, tmp_path):
    load_tokenizer(tiny_gguf).save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "config.json").write_text(LlamaConfig(**TINY).to_json_string())
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert tokenizer.decode(tokenizer("hello there")["input_ids"]) == "hello there"


def test_missing_paths_raise_file_not_found(tmp_path):
    for spec in (tmp_path / "nope", str(tmp_path / "nope"), "./nope", "a/b/c", "missing.gguf", tmp_path / "x.gguf"):
        with pytest.raises(FileNotFoundError, match="no such model file or folder") as info:
            load_model(spec)
        assert isinstance(info.value, ModelSpecError)
        assert Path(spec).name in str(info.value)


def test_folder_without_config_and_other_files_are_rejected(tmp_path):
    with pytest.raises(ModelSpecError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="neither a .gguf file nor a model folder"):
        load_tokenizer(tmp_path / "weights.bin")


def test_a_checkpoint_with_bad_linearize_settings_names_its_config(tmp_path):
    """A hand-edited (or corrupted) option in a linearized checkpoint's config.json is a one-line error
    naming the file, not the method's own message alone."""
    from tiny_models import TINY_OPTIONS, tiny_teacher

    import linearize

    model = linearize.convert(tiny_teacher(), "lizard", **TINY_OPTIONS["lizard"])
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["linearize"]["options"]["chunkOsize"] = config["linearize"]["options"].pop("chunk_size", 8)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSpecError, match=r"config.json's linearize settings are invalid \(lizard has no option"):
        load_model(str(tmp_path))


def test_a_model_folder_without_tokenizer_files_says_so(tmp_path):
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(tmp_path)
    with pytest.raises(ModelSpecError, match="holds a model but no tokenizer"):
        load_tokenizer(tmp_path)


def test_unreachable_hub_fails_fast_with_one_line(monkeypatch):
    monkeypatch.setattr(loading, "hub_reachable", lambda: False)
    assert resolve_spec("some-org/no-such-model") == ("hub", "some-org/no-such-model")
    with pytest.raises(ModelSpecError, match="cannot be reached") as info:
        load_model("some-org/no-such-model")
    assert "\n" not in str(info.value)
    assert not isinstance(info.value, ModelNotFoundError)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2"), load_tokenizer("smollm2")


@pytest.mark.slow
def test_smollm2_shape_and_greedy_answer(smollm2):
    model, tokenizer = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size) == (30, 9, 3, 576)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])


@pytest.mark.slow
def test_smollm2_tokenizer_round_trip_and_chat_template(smollm2):
    model, tokenizer = smollm2
    text = "Call me Ishmael. Some years ago—never mind how long precisely—I thought I would sail about.\n\tÜber 42!"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and "What is the capital of France?" in prompt
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma3"), load_tokenizer("gemma3")


@pytest.mark.slow
def test_gemma3_shape_tokenizer_and_greedy_answer(gemma3):
    model, tokenizer = gemma3
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.hidden_size, cfg.vocab_size, cfg.max_position_embeddings, cfg.sliding_window) == (
        "gemma3_text", 18, 4, 1, 256, 640, 262144, 32768, 512)
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert tokenizer.tokenize("The capital") == ["The", "▁capital"]  # the GGUF's own vocabulary gives "▁c ap it al"
    assert (tokenizer.bos_token_id, tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        2, "<eos>", 1, 0)
    text = "Call me Ishmael. Some years ago—never mind how long precisely—I thought\n\tÜber 42!"
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
    inputs = tokenizer("The capital of France is the city of", return_tensors="pt")
    assert inputs["input_ids"][0, 0] == tokenizer.bos_token_id
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(out[0, inputs["input_ids"].shape[1]:]).startswith(" Paris.")
