"""Which layers a hybrid keeps softmax (`softmax_by`: error, even, kl): the rules, the KL-guided scores
against a direct computation, Gemma's sliding layers left out, end-to-end distills, flags and recipes."""

import argparse
import dataclasses
import itertools
import json
import math

import pytest
import torch
from tiny_models import ARCHITECTURES, TINY_OPTIONS, perturb_new_parameters, tiny_teacher, tiny_tokenizer
from transformers import AutoModelForCausalLM

import linearize  # noqa: F401  (registers the linearized model types with the Auto classes)
from linearize.attention import LinearizedAttention
from linearize.config import ConfigError
from linearize.convert import check_layer_choice, convert
from linearize.recipes import Recipe, RecipeError
from linearize.train import DistillConfig, distill
from linearize.train.command import config_from_args, register
from linearize.train.distillation import Run
from linearize.train.layer_report import layer_figure
from linearize.train.layer_selection import (
    KLSelection,
    even_layers,
    kl_distillation_loss,
    kl_teacher_states,
    linearized_attention,
    mean_kl,
    restored_layer_kl,
    softmax_in,
    teacher_final_states,
    teacher_mode,
    top_layers,
)
from linearize.train.student import prepare_stage

# Gemma 3 with three full-attention layers among six (the tiny default has one): `layers="full"` then
# linearizes 1, 3 and 5 and keeps the sliding ones.
GEMMA_FULL = {"num_hidden_layers": 6, "layer_types": ["sliding_attention", "full_attention"] * 3}


def direct_kl(teacher_logits, student_logits) -> float:
    """Mean over positions of sum_v p_teacher (log p_teacher - log p_student), in float64."""
    p, q = teacher_logits.double().log_softmax(-1), student_logits.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def logits(model, batches):
    with torch.no_grad():
        return [model(input_ids=ids, use_cache=False).logits for ids in batches]


# ---------------------------------------------------------------------------------------------------
# The rules.


def test_even_takes_the_middle_of_n_equal_groups():
    thirty = list(range(30))
    # The layers the SmolLM2 ablations chose by hand (recipes/ablations/lizard-hybrid-{25,50}-even.yaml).
    assert even_layers(thirty, 15) == list(range(1, 30, 2))
    assert even_layers(thirty, 8) == [1, 5, 9, 13, 16, 20, 24, 28]
    assert even_layers(thirty, 1) == [15]
    assert even_layers(list(range(4)), 2) == [1, 3]
    # Over the linearized layers only, whatever their indices (Gemma's full layers, say).
    assert even_layers([5, 11, 17], 1) == [11]
    assert even_layers([5, 11, 17], 2) == [5, 17]
    for n in range(1, 30):
        picked = even_layers(thirty, n)
        assert len(set(picked)) == n and picked == sorted(picked)
    for bad in (0, 30):
        with pytest.raises(ValueError, match="needs 1 <= N < 30"):
            even_layers(thirty, bad)


def test_top_layers_takes_the_highest_scores_ties_to_the_lower_index():
    scores = {0: 0.1, 1: 0.5, 2: 0.3, 3: 0.5, 4: -1.0}
    assert top_layers(scores, 1) == [1]
    assert top_layers(scores, 2) == [1, 3]
    assert top_layers(scores, 3) == [1, 2, 3]


# ---------------------------------------------------------------------------------------------------
# The KL-guided scores against a direct computation.


# `make test` takes each method once, and each of the two layer sets once; the rest run in `make test-all`.
KL_CASES = [(method, arch, layers) for method in ("lizard", "still")
            for arch, layers in [("llama", "all"), ("gemma2", "all"), ("gemma3_text", "all"), ("gemma3_text", "full")]]
FAST_KL_CASES = [("lizard", "llama", "all"), ("still", "gemma3_text", "full")]


@pytest.mark.parametrize("method,arch,layers", [
    pytest.param(*case, marks=() if case in FAST_KL_CASES else pytest.mark.slow) for case in KL_CASES])
def test_each_layers_kl_equals_a_model_built_with_only_that_layer_softmax(method, arch, layers):
    # Gemma 2: its final logit soft-cap, which the chunked KL applies to the logits it forms.
    overrides = GEMMA_FULL if arch == "gemma3_text" else {"num_hidden_layers": 3}
    # In float64, so that the two computations agree far closer (~1e-7: the softmax the scoring switches
    # to, stage 1's target, takes Lizard's q and k as rotated in float32) than the layers' scores differ.
    teacher = tiny_teacher(arch, **overrides).double()
    model = convert(tiny_teacher(arch, **overrides).double(), method, layers=layers, **TINY_OPTIONS[method])
    perturb_new_parameters(model)  # the new modules away from their init, so that each layer's linear output is off
    model.eval()
    expected_layers = [1, 3, 5] if layers == "full" else list(range(overrides["num_hidden_layers"]))
    assert sorted(linearized_attention(model)) == expected_layers
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 128, (2, 24), generator=generator) for _ in range(2)]
    teacher_logits = logits(teacher, batches)

    all_linear, restored = restored_layer_kl(model, batches)

    def kl_of(student) -> float:
        # Every batch holds as many tokens: the mean over tokens is the mean of the batch means.
        kls = [direct_kl(t, s) for t, s in zip(teacher_logits, logits(student, batches))]
        return sum(kls) / len(kls)

    assert sorted(restored) == expected_layers
    assert all_linear == pytest.approx(kl_of(model), rel=1e-5, abs=1e-12)
    assert all_linear > 1e-4  # the linear layers really are off the teacher
    for i in expected_layers:
        # By hand: the teacher converted again with layer i softmax, the scored model's weights loaded.
        softmax_i = sorted({i} | (set(range(overrides["num_hidden_layers"])) - set(expected_layers)))
        hand = convert(tiny_teacher(arch, **overrides).double(), method, softmax_layers=[i], layers=layers,
                       **TINY_OPTIONS[method]).eval()
        assert hand.config.linearize["softmax_layers"] == softmax_i
        assert hand.load_state_dict(model.state_dict(), strict=False).missing_keys == []
        assert restored[i] == pytest.approx(kl_of(hand), rel=1e-5, abs=1e-12), i
    scores = sorted([all_linear, *restored.values()])
    assert all(b - a > 1e-4 * b for a, b in itertools.pairwise(scores))  # 10x the tolerance: every layer told apart
    # Scoring switched layers, never weights, and switched every one back.
    assert not any(a.attention_transfer for a in linearized_attention(model).values())
    assert all_linear == pytest.approx(kl_of(model), rel=1e-5, abs=1e-12)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_model_with_every_layer_switched_to_softmax_is_the_teacher(arch):
    """The KL's reference, on every supported architecture (Gemma's sliding windows, Gemma 2's logit cap,
    Phi-3's fused projections, q/k norms)."""

    overrides = GEMMA_FULL if arch == "gemma3_text" else {}
    teacher = tiny_teacher(arch, **overrides)
    model = convert(tiny_teacher(arch, **overrides), "lizard", **TINY_OPTIONS["lizard"]).eval()
    perturb_new_parameters(model)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with softmax_in(model, range(model.config.num_hidden_layers)):
        switched = logits(model, [ids])[0]
    torch.testing.assert_close(switched, logits(teacher, [ids])[0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(logits(model, [ids])[0], switched, atol=1e-3)


def lora_student(arch="llama", **overrides):
    """A converted tiny teacher under stage 2's LoRA, its new modules and adapters away from their init
    (LoRA's B starts at zero, where the adapters change nothing)."""
    model = convert(tiny_teacher(arch, **overrides), "lizard", **TINY_OPTIONS["lizard"])
    perturb_new_parameters(model)
    model, names = prepare_stage(model, DistillConfig(model="m", method="lizard", out="o"), 2)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return model, names


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_teacher_mode_turns_off_the_adapters_and_switches_every_layer(arch):
    overrides = GEMMA_FULL if arch == "gemma3_text" else {}
    teacher = tiny_teacher(arch, **overrides).eval()
    model, _ = lora_student(arch, **overrides)
    model.eval()
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with teacher_mode(model):
        as_teacher = logits(model, [ids])[0]
    torch.testing.assert_close(as_teacher, logits(teacher, [ids])[0], rtol=1e-4, atol=1e-5)
    # Outside it, the student; and with only the layers switched (adapters on), neither.
    assert not torch.allclose(logits(model, [ids])[0], as_teacher, atol=1e-3)
    with softmax_in(model, linearized_attention(model)):
        assert not torch.allclose(logits(model, [ids])[0], as_teacher, atol=1e-3)


def test_the_kl_distillation_loss_is_the_mean_token_kl_and_trains_the_adapters_alone():
    teacher = tiny_teacher().eval()
    model, names = lora_student()
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = kl_distillation_loss(model, ids)
    assert loss.dtype == torch.float32 and loss.requires_grad
    with torch.no_grad():
        expected = direct_kl(teacher(input_ids=ids).logits, model(input_ids=ids, use_cache=False).logits)
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == names and all("lora_" in name for name in grads)
    assert any(g.abs().sum() > 0 for name, g in grads.items() if "lora_A" in name)
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_teacher_computed_once_gives_the_loss_and_scores_of_one_computed_each_time(arch):
    """KL-guided selection's candidates share the teacher's states (`KLTeacher`): the loss on them is the
    loss that computes its own teacher, values and gradients, and `mean_kl` scores alike with them."""
    model, _ = lora_student(arch)
    model.train()
    batches = [torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    own = kl_distillation_loss(model, batches[0])
    own.backward()
    own_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    given = kl_distillation_loss(model, batches[0], kl_teacher_states(model, batches[0]))
    given.backward()
    assert given.item() == own.item()
    assert {name for name, p in model.named_parameters() if p.grad is not None} == set(own_grads)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, own_grads[name], rtol=0, atol=0)
    students = [lambda: softmax_in(model, []), lambda: softmax_in(model, [min(linearized_attention(model))])]
    assert mean_kl(model, batches, students, teachers=teacher_final_states(model, batches)) == \
        mean_kl(model, batches, students)
    assert model.training


def test_a_head_other_than_a_bias_free_linear_takes_the_kl_from_full_logits():
    """`final_states` hands over HF's logits where the head is not a bias-free Linear; the KL is the same."""
    from linearize.train.layer_selection import final_states, mean_token_kl
    from linearize.train.losses import linear_head

    model = convert(tiny_teacher(), "lizard", **TINY_OPTIONS["lizard"]).eval()
    perturb_new_parameters(model)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))

    def kl() -> torch.Tensor:
        with torch.no_grad():
            with teacher_mode(model):
                teacher = final_states(model, ids)
            return teacher.shape[-1], mean_token_kl(model, teacher, final_states(model, ids))

    features, chunked = kl()
    assert features == model.config.hidden_size and linear_head(model)[0] is model.lm_head
    biased = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        biased.weight.copy_(model.lm_head.weight)
        biased.bias.zero_()
    model.lm_head = biased
    features, full = kl()
    assert features == model.config.vocab_size and linear_head(model)[0] is None
    # A KL of ~3e-4 nats is a difference of nearly equal float32 sums: the two paths' reduction orders
    # part by ~1e-7 absolute, a relative 1e-4 only for some draws of the model.
    assert full.item() == pytest.approx(chunked.item(), rel=1e-4, abs=1e-6) and chunked.item() > 1e-5


# ---------------------------------------------------------------------------------------------------
# End to end: tiny distills on the CPU.


def config(workspace, out, **overrides):
    base = {"model": str(workspace / "teacher"), "method": "lizard", "out": str(out), "data": str(workspace / "data.txt"),
            "max_tokens": 4 * 32 * 4, "seq_len": 32, "batch": 4, "options": {"window": 8, "num_sinks": 2},
            "save_every": 3, "eval_every": 4, "val_batches": 2, "lr_stage1": 3e-2, "lr_stage2": 2e-3}
    return DistillConfig(**{**base, **overrides})


def scores_of(out):
    return json.loads((out / "stage1_layer_errors.json").read_text())


def figure_of(out):
    return out / "stage1_layer_errors.png"


@pytest.mark.parametrize("kl_train_steps", [0, 2])
@pytest.mark.parametrize("method", ["lizard", "still"])
def test_kl_keeps_softmax_the_layer_whose_restoring_lowers_kl_most_and_the_model_loads(workspace, tmp_path, method,
                                                                                      kl_train_steps):
    options = {"window": 8, "num_sinks": 2} if method == "lizard" else TINY_OPTIONS["still"]
    out = distill(config(workspace, tmp_path / "run", method=method, options=options, softmax_by="kl:1",
                         kl_train_steps=kl_train_steps), progress=False)
    record = scores_of(out)
    assert record["kl_train_steps"] == kl_train_steps
    restored = {int(k): v for k, v in record["kl_restored"].items()}
    gains = {int(k): v for k, v in record["kl_gain"].items()}
    assert set(restored) == set(gains) == {int(k) for k in record["mse"]} == {0, 1}
    assert all(gains[i] == pytest.approx(record["kl_all_linear"] - restored[i]) for i in gains)
    assert record["kl_all_linear"] > 0
    assert record["softmax_by"] == "kl:1" and record["picked"] == [min(restored, key=restored.get)]
    assert record["picked"] == [max(gains, key=gains.get)]
    assert figure_of(out).exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.linearize["softmax_layers"] == record["picked"] and model.config.linearize["distilled"]
    kinds = [type(layer.self_attn).__name__ for layer in model.model.layers]
    picked = record["picked"][0]
    assert kinds[picked] == type(tiny_teacher().model.layers[0].self_attn).__name__
    assert kinds[1 - picked] != kinds[picked]
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(3, 100, (1, 12))).logits).all()


def test_kl_train_steps_trains_each_candidate_towards_the_teacher_before_scoring_it(workspace, tmp_path):
    # A teacher initialised ten times wider than the default: its next-token distributions are sharp
    # enough (all-linear KL ~1.4 nats) for three steps to move every candidate measurably towards it.
    teacher = tmp_path / "teacher"
    tiny_teacher(initializer_range=0.2).save_pretrained(teacher)
    tiny_tokenizer().save_pretrained(teacher)
    settings = {"model": str(teacher), "softmax_by": "kl:1"}
    untrained = scores_of(distill(config(workspace, tmp_path / "untrained", **settings), progress=False))
    out = distill(config(workspace, tmp_path / "trained", **settings, kl_train_steps=3), progress=False)
    record = scores_of(out)
    assert record["kl_train_steps"] == 3 and untrained["kl_train_steps"] == 0 and "kl_candidates" not in record
    assert record["mse"] == untrained["mse"]  # the same stage 1
    restored = {int(k): v for k, v in record["kl_restored"].items()}
    assert set(restored) == {0, 1}
    # Three steps on the KL to the teacher leave every candidate closer to it than its untrained self.
    assert record["kl_all_linear"] < untrained["kl_all_linear"]
    assert all(restored[i] < untrained["kl_restored"][str(i)] for i in restored)
    assert record["picked"] == [min(restored, key=restored.get)]
    assert all(record["kl_gain"][str(i)] == pytest.approx(record["kl_all_linear"] - restored[i]) for i in restored)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.linearize["softmax_layers"] == record["picked"]


def test_an_interrupted_kl_selection_resumes_at_the_next_candidate(workspace, tmp_path, monkeypatch, capsys):
    whole = scores_of(distill(config(workspace, tmp_path / "whole", softmax_by="kl:1", kl_train_steps=2),
                              progress=False))
    scored = []
    original = KLSelection.candidate_kl

    def interrupted_at_the_second(self, restored):
        if len(scored) == 1:
            raise KeyboardInterrupt
        scored.append(restored)
        return original(self, restored)

    monkeypatch.setattr(KLSelection, "candidate_kl", interrupted_at_the_second)
    cfg = config(workspace, tmp_path / "cut", softmax_by="kl:1", kl_train_steps=2)
    with pytest.raises(KeyboardInterrupt):
        distill(cfg, progress=False)
    assert "1 of 3 candidates scored" in capsys.readouterr().out
    partial = scores_of(tmp_path / "cut")
    assert list(partial["kl_candidates"]) == ["all_linear"] and "picked" not in partial
    assert not figure_of(tmp_path / "cut").exists()  # drawn once the choice is made
    monkeypatch.setattr(KLSelection, "candidate_kl", lambda self, restored: scored.append(restored) or original(self, restored))
    distill(cfg, resume=True, progress=False)
    assert scored == [None, 0, 1]  # the all-linear candidate once, then the two not yet scored
    resumed = scores_of(tmp_path / "cut")
    assert figure_of(tmp_path / "cut").exists()
    for key in ("kl_all_linear", "kl_restored", "picked", "mse"):
        assert resumed[key] == pytest.approx(whole[key]), key


def test_even_is_chosen_before_training_and_needs_no_second_stage(workspace, tmp_path):
    out = distill(config(workspace, tmp_path / "run", softmax_by="even:1", stage="1"), progress=False)
    record = scores_of(out)
    # Stage 1 trained layer 0 alone: layer 1, the middle of the one group {0, 1}, was softmax from the start.
    assert set(record["mse"]) == {"0"} and record["picked"] == [1] and record["softmax_by"] == "even:1"
    assert figure_of(out).exists()
    stage1 = torch.load(out / "stage1_attention.pt")
    assert stage1 and all(".layers.0." in name for name in stage1)
    assert AutoModelForCausalLM.from_pretrained(out).config.linearize["softmax_layers"] == [1]


def test_a_run_saved_with_softmax_by_error_resumes_as_error_n(workspace, tmp_path):
    out = distill(config(workspace, tmp_path / "run", softmax_by="error:1"), progress=False)
    record = scores_of(out)
    errors = {int(k): v for k, v in record["mse"].items()}
    assert record["picked"] == [max(errors, key=errors.get)] and "kl_restored" not in record
    # The same run, its config saved with the error rule as `softmax_by_error: 1`.
    saved = json.loads((out / "distill_config.json").read_text())
    del saved["softmax_by"]
    (out / "distill_config.json").write_text(json.dumps({**saved, "softmax_by_error": 1}))
    assert distill(config(workspace, tmp_path / "run", softmax_by="error:1"), resume=True, progress=False) == out


@pytest.mark.parametrize("kl_train_steps", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_layers_full_chooses_among_the_full_attention_layers_only(workspace, tmp_path, kl_train_steps):
    teacher = tmp_path / "gemma"
    tiny_teacher("gemma3_text", **GEMMA_FULL).save_pretrained(teacher)
    tiny_tokenizer().save_pretrained(teacher)
    cfg = DistillConfig(model=str(teacher), method="lizard", out=str(tmp_path / "run"), data=str(workspace / "data.txt"),
                        layers="full", softmax_by="kl:2", kl_train_steps=kl_train_steps, max_tokens=4 * 32 * 2,
                        seq_len=32, batch=4,
                        options={"window": 8, "num_sinks": 2}, val_batches=1, save_every=10, eval_every=10)
    out = distill(cfg, progress=False)
    record = scores_of(out)
    assert set(record["kl_restored"]) == set(record["mse"]) == {"1", "3", "5"}
    assert len(record["picked"]) == 2 and set(record["picked"]) <= {1, 3, 5}
    model = AutoModelForCausalLM.from_pretrained(out)
    linear = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.self_attn, LinearizedAttention)]
    assert linear == sorted({1, 3, 5} - set(record["picked"]))
    assert model.config.linearize["softmax_layers"] == sorted({0, 2, 4} | set(record["picked"]))
    # even over the same three: the middle one.
    even = distill(dataclasses.replace(cfg, out=str(tmp_path / "even"), softmax_by="even:1", kl_train_steps=0,
                                       stage="1"), progress=False)
    assert scores_of(even)["picked"] == [3]
    # Three full layers: N = 3 would leave none.
    with pytest.raises(ConfigError, match="--softmax-by kl:3: the model has 3 linearized layer"):
        distill(dataclasses.replace(cfg, out=str(tmp_path / "bad"), softmax_by="kl:3"), progress=False)
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------------------------------
# Hybrids sharing one stage 1 (`stage1_from`).


@pytest.fixture
def three_layer_source(workspace, tmp_path):
    """A kl:1 run (candidates trained 1 step) on a 3-layer teacher: the stage 1 the other runs take."""
    teacher = tmp_path / "teacher3"
    tiny_teacher(num_hidden_layers=3).save_pretrained(teacher)
    tiny_tokenizer().save_pretrained(teacher)
    return distill(config(workspace, tmp_path / "source", model=str(teacher), softmax_by="kl:1", kl_train_steps=1),
                   progress=False)


@pytest.mark.slow
def test_a_run_from_another_runs_stage_1_takes_its_tensors_and_kl_scores_and_picks_its_own_n(
        workspace, tmp_path, three_layer_source, monkeypatch):
    source = three_layer_source
    theirs = scores_of(source)

    def no_scoring(*_):
        raise AssertionError("the candidates were scored again")

    monkeypatch.setattr(KLSelection, "candidate_kl", no_scoring)
    out = distill(config(workspace, tmp_path / "kl2", model=str(source.parent / "teacher3"), softmax_by="kl:2",
                         kl_train_steps=1, stage1_from=str(source)), progress=False)
    mine = scores_of(out)
    assert mine["stage1_from"] == str(source)
    assert {key: mine[key] for key in ("mse", "kl_all_linear", "kl_restored", "kl_gain", "kl_train_steps")} == \
        {key: theirs[key] for key in ("mse", "kl_all_linear", "kl_restored", "kl_gain", "kl_train_steps")}
    assert mine["picked"] == top_layers({int(k): v for k, v in theirs["kl_gain"].items()}, 2) != theirs["picked"]
    tensors = torch.load(out / "stage1_attention.pt"), torch.load(source / "stage1_attention.pt")
    assert tensors[0].keys() == tensors[1].keys()
    assert all(torch.equal(tensors[0][name], tensors[1][name]) for name in tensors[0])
    assert {record["stage"] for record in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())} == {2}
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.linearize["softmax_layers"] == mine["picked"]


@pytest.mark.slow
def test_another_rule_or_other_candidate_training_picks_anew_from_the_taken_stage_1(workspace, tmp_path,
                                                                                       three_layer_source):
    source, teacher = three_layer_source, str(three_layer_source.parent / "teacher3")
    theirs = scores_of(source)
    error = scores_of(distill(config(workspace, tmp_path / "error", model=teacher, softmax_by="error:2",
                                     stage1_from=str(source)), progress=False))
    assert error["mse"] == theirs["mse"] and "kl_restored" not in error
    assert error["picked"] == top_layers({int(k): v for k, v in theirs["mse"].items()}, 2)
    longer = scores_of(distill(config(workspace, tmp_path / "kl3steps", model=teacher, softmax_by="kl:1",
                                      kl_train_steps=3, stage1_from=str(source)), progress=False))
    assert longer["mse"] == theirs["mse"] and longer["kl_train_steps"] == 3
    assert longer["kl_all_linear"] != theirs["kl_all_linear"]  # scored again, three steps a candidate


def test_the_candidates_share_one_teacher_forward_per_batch(workspace, tmp_path, monkeypatch):
    """Trained candidates: the teacher runs once on each training micro-batch and validation batch for
    the whole selection, not once per candidate."""
    from linearize.train import layer_selection

    calls = {"kl_teacher_states": 0, "teacher_final_states": 0}

    def counted(name):
        original = getattr(layer_selection, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return wrapper

    for name in calls:
        monkeypatch.setattr(layer_selection, name, counted(name))
    teacher = tmp_path / "teacher3"
    tiny_teacher(num_hidden_layers=3).save_pretrained(teacher)
    tiny_tokenizer().save_pretrained(teacher)
    cfg = config(workspace, tmp_path / "run", model=str(teacher), softmax_by="kl:1", kl_train_steps=2, grad_accum=2)
    scores = scores_of(distill(cfg, progress=False))
    assert len(scores["kl_restored"]) == 3  # four candidates: none and each of the three layers
    assert calls == {"kl_teacher_states": cfg.kl_train_steps * cfg.grad_accum, "teacher_final_states": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trained_candidates_under_a_cuda_graph_score_as_eager_ones(workspace, tmp_path, monkeypatch):
    """On the GPU, the candidates' steps past the warm-up replay a captured graph on the shared teacher's
    states: the scores are the eager steps' to bf16 accuracy."""
    from linearize.train import layer_selection
    from linearize.train.step import WARMUP_STEPS, TrainStep

    steps = []

    class Recorded(TrainStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            steps.append(self)

    monkeypatch.setattr(layer_selection, "TrainStep", Recorded)
    teacher = tmp_path / "teacher3"
    tiny_teacher(num_hidden_layers=3).save_pretrained(teacher)
    tiny_tokenizer().save_pretrained(teacher)
    scores = {}
    for graphed in (False, True):
        out = tmp_path / f"graph-{graphed}"
        steps.clear()
        distill(config(workspace, out, model=str(teacher), softmax_by="kl:1", kl_train_steps=WARMUP_STEPS + 3,
                       cuda_graph=graphed, device="cuda"), progress=False)
        scores[graphed] = scores_of(out)
    # The four candidates' steps (the stages take 4 steps each here, the candidates WARMUP_STEPS + 3).
    candidates = [step for step in steps if step.steps == WARMUP_STEPS + 3]
    assert len(candidates) == 4 and all(step.path == "cuda graph" for step in candidates)
    for key in ("kl_all_linear", "kl_restored"):
        assert scores[True][key] == pytest.approx(scores[False][key], rel=3e-2)
    assert all(math.isfinite(v) for v in scores[True]["kl_restored"].values())


def test_a_stage_1_trained_otherwise_is_refused_before_any_work(workspace, tmp_path, three_layer_source):
    source, teacher = three_layer_source, str(three_layer_source.parent / "teacher3")
    cases = [({"seq_len": 16}, "seq_len: saved 32, asked 16"),
             ({"lr_stage1": 1e-3}, "lr_stage1: saved 0.03, asked 0.001"),
             ({"softmax_by": "even:1"}, 'softmax_by: saved "kl:1", asked "even:1"'),
             ({"options": {"window": 4, "num_sinks": 2}}, "options.window: saved 8, asked 4")]
    for overrides, change in cases:
        with pytest.raises(ValueError, match=f"^--stage1-from {source}: its stage 1 was trained with other settings "
                                             rf"\(saved there, asked here\): {change}$"):
            distill(config(workspace, tmp_path / "run", model=teacher, stage1_from=str(source), **overrides),
                    progress=False)
        assert not (tmp_path / "run").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no finished stage 1 there \\(distill_config.json is missing\\)"):
        distill(config(workspace, tmp_path / "run", model=teacher, stage1_from=str(tmp_path / "empty")), progress=False)
    with pytest.raises(ValueError, match="this run's own --out"):
        distill(config(workspace, tmp_path / "self", model=teacher, stage1_from=str(tmp_path / "self")), progress=False)
    with pytest.raises(ValueError, match=r"needs both stages \(--stage both\)"):
        config(workspace, tmp_path / "run", stage="1", stage1_from=str(source))


def test_an_interrupted_run_resumes_with_the_stage_1_it_took(workspace, tmp_path, three_layer_source, monkeypatch):
    source, teacher = three_layer_source, str(three_layer_source.parent / "teacher3")
    cfg = config(workspace, tmp_path / "run", model=teacher, softmax_by="error:1", stage1_from=str(source))
    from linearize.train import distillation

    original = distillation.train_stage

    def stop_in_stage_2(run, stage):
        if stage == 2:
            raise KeyboardInterrupt
        original(run, stage)

    monkeypatch.setattr(distillation, "train_stage", stop_in_stage_2)
    with pytest.raises(KeyboardInterrupt):
        distill(cfg, progress=False)
    monkeypatch.setattr(distillation, "train_stage", original)
    (source / "stage1_attention.pt").unlink()  # taken already: the source is not read again
    out = distill(cfg, resume=True, progress=False)
    assert scores_of(out)["picked"] == top_layers({int(k): v for k, v in scores_of(out)["mse"].items()}, 1)
    assert (out / "config.json").exists()


# ---------------------------------------------------------------------------------------------------
# Settings: the config, the flags, recipes.


def test_softmax_by_settings():
    make = lambda **kw: DistillConfig(model="m", method="lizard", out="o", **kw)
    assert make().softmax_by is None and make().selection is None
    assert make(softmax_by="kl:2").selection == ("kl", 2)
    assert make(softmax_by=" even:02").softmax_by == "even:2"
    assert make(softmax_by="even:2", stage="1").selection == ("even", 2)  # even needs no stage 1 scores
    for bad, message in (("kl:x", "whole number >= 1"), ("kl:0", "whole number >= 1"), ("foo:2", "RULE one of"),
                         ("kl", "RULE one of"), ("", "RULE one of")):
        with pytest.raises(ValueError, match=message):
            make(softmax_by=bad)
    with pytest.raises(TypeError, match="RULE:N"):
        make(softmax_by=2)
    for rule in ("kl", "error"):
        for stage in ("1", "2"):
            with pytest.raises(ValueError, match="needs both stages"):
                make(softmax_by=f"{rule}:1", stage=stage)
    with pytest.raises(TypeError, match="softmax_by_error"):
        make(softmax_by_error=2)  # saved configs only: `from_json` reads it as error:N
    assert make(softmax_by="kl:2", kl_train_steps=20).kl_train_steps == 20
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="kl_train_steps must be a whole number >= 0"):
            make(softmax_by="kl:2", kl_train_steps=bad)
    for other in (None, "error:2", "even:2"):
        with pytest.raises(ValueError, match="trains the candidates of softmax_by kl:N"):
            make(softmax_by=other, kl_train_steps=5)
    assert make(softmax_by="kl:2", kl_train_steps=5).same_run(make(softmax_by="kl:2")) == ["kl_train_steps"]
    assert make(softmax_by="kl:2", kl_seq_len=4096).kl_seq_len == 4096
    for bad in (-1, 1.5, True, "4096"):
        with pytest.raises(ValueError, match="kl_seq_len must be a whole number >= 0"):
            make(softmax_by="kl:2", kl_seq_len=bad)
    for other in (None, "error:2"):
        with pytest.raises(ValueError, match="the length softmax_by kl:N scores its candidates on"):
            make(softmax_by=other, kl_seq_len=4096)
    assert make(softmax_by="kl:2", kl_seq_len=64).same_run(make(softmax_by="kl:2")) == ["kl_seq_len"]


def test_a_saved_config_with_softmax_by_error_loads_as_error_n(tmp_path):
    saved = json.loads(DistillConfig(model="m", method="lizard", out="o").to_json())
    del saved["softmax_by"]
    saved["softmax_by_error"] = 8
    (tmp_path / "distill_config.json").write_text(json.dumps(saved))
    old = DistillConfig.from_json(tmp_path / "distill_config.json")
    assert old.softmax_by == "error:8"
    assert DistillConfig(model="m", method="lizard", out="o", softmax_by="error:8").same_run(old) == []
    assert DistillConfig(model="m", method="lizard", out="o", softmax_by="kl:8").same_run(old) == ["softmax_by"]


def test_check_layer_choice_counts_the_linearized_layers():
    check_layer_choice(30, "lizard", softmax_by="kl:29")
    check_layer_choice(6, "lizard", kept=[0, 2, 4], softmax_by="even:2")
    with pytest.raises(ConfigError, match="--softmax-by even:3: the model has 3 linearized layer"):
        check_layer_choice(6, "lizard", kept=[0, 2, 4], softmax_by="even:3")
    with pytest.raises(ConfigError, match="--softmax-by kl:2: the model has 2 linearized"):
        check_layer_choice(4, "still", softmax_layers=[0, 1], softmax_by="kl:2")
    with pytest.raises(ConfigError, match="--softmax-by error:4: the model has 4 linearized"):
        check_layer_choice(4, "lizard", softmax_by="error:4")


@pytest.mark.parametrize("flags,expected", [
    ([], None), (["--softmax-by", "kl:2"], "kl:2"), (["--softmax-by", "even:15"], "even:15"),
    (["--softmax-by", "error:8"], "error:8"),
])
def test_the_softmax_by_flag(flags, expected):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())  # the distill command's parser alone
    args = parser.parse_args(["distill", "--model", "m", "--method", "still", "--out", "o", *flags])
    assert config_from_args(args).softmax_by == expected


def test_the_kl_train_steps_flag(capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    base = ["distill", "--model", "m", "--method", "still", "--out", "o", "--softmax-by", "kl:2"]
    assert config_from_args(parser.parse_args([*base, "--kl-train-steps", "25"])).kl_train_steps == 25
    assert config_from_args(parser.parse_args(base)).kl_train_steps == 0
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([*base, "--kl-train-steps", "-2"])
    assert exit_info.value.code == 2 and "expected an integer >= 0" in capsys.readouterr().err


def test_the_kl_seq_len_flag():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    base = ["distill", "--model", "m", "--method", "still", "--out", "o", "--softmax-by", "kl:2"]
    assert config_from_args(parser.parse_args([*base, "--kl-seq-len", "4096"])).kl_seq_len == 4096
    assert config_from_args(parser.parse_args(base)).kl_seq_len == 0


@pytest.mark.parametrize("kl_train_steps", [0, 2])
def test_kl_seq_len_scores_the_candidates_on_longer_sequences(workspace, tmp_path, monkeypatch, kl_train_steps):
    """STILL trains at 32 tokens here and its candidates are scored on 64-token sequences: every batch the
    scoring reads is 64 tokens long (the training's validation stays at 32), and the record and figure say so."""
    from linearize.train import layer_selection

    lengths = {"scored": set(), "validated": set()}
    for name, key in (("mean_kl", "scored"), ("restored_layer_kl", "scored")):
        original = getattr(layer_selection, name)

        def spy(model, batches, *args, _original=original, _key=key, **kwargs):
            batches = list(batches)
            lengths[_key].update(ids.shape[1] for ids in batches)
            return _original(model, batches, *args, **kwargs)

        monkeypatch.setattr(layer_selection, name, spy)
    validation = Run.validation_batches

    def seen(self, blocks=None):
        batches = list(validation(self, blocks))
        if blocks is None:
            lengths["validated"].update(ids.shape[1] for ids in batches)
        return iter(batches)

    monkeypatch.setattr(Run, "validation_batches", seen)
    out = distill(config(workspace, tmp_path / "run", method="still", options=TINY_OPTIONS["still"], softmax_by="kl:1",
                         kl_train_steps=kl_train_steps, kl_seq_len=64), progress=False)
    assert lengths == {"scored": {64}, "validated": {32}}
    record = scores_of(out)
    assert record["kl_seq_len"] == 64 and len(record["picked"]) == 1
    assert "scored on 64-token sequences" in layer_figure(record).axes[1].get_title()


def test_a_kl_seq_len_the_data_cannot_fill_is_refused_before_any_work(workspace, tmp_path):
    too_few = r"1 KL validation sequence\(s\) of 4096 tokens, fewer than one batch of 4: .* or --kl-seq-len$"
    for length, message in ((4096, too_few),
                            (1_000_000, r"^--kl-seq-len 1000000: The data .* fewer than one block of 1000000")):
        with pytest.raises(ValueError, match=message):
            distill(config(workspace, tmp_path / "run", softmax_by="kl:1", kl_seq_len=length), progress=False)
        assert not (tmp_path / "run").exists()


def test_the_command_says_which_layers_it_kept_softmax(workspace, tmp_path, capsys):
    from linearize.cli import main

    out = tmp_path / "run"
    main(["distill", "--model", str(workspace / "teacher"), "--data", str(workspace / "data.txt"), "--method", "lizard",
          "--out", str(out), "--max-tokens", "512", "--seq-len", "32", "--batch", "4", "--softmax-by", "error:1",
          "--set", "window=8", "--set", "num_sinks=2"])
    [picked] = scores_of(out)["picked"]
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == (f"kept softmax by error:1: layer {picked} (the scores: {out / 'stage1_layer_errors.json'}; "
                         f"their figure: {figure_of(out)})")


def test_a_recipes_stage1_from_names_a_row_in_the_same_runs_folder(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("extends: lizard\ndistill:\n  softmax_by: kl:4\n  stage1_from: lizard-kl-2\n")
    cfg = Recipe.load(path).distill_config(tmp_path / "runs" / "r" / "model")
    assert cfg.stage1_from == str(tmp_path / "runs" / "lizard-kl-2" / "model")
    with pytest.raises(RecipeError, match="stage1_from must be a run folder"):
        Recipe.load(path, ["distill.stage1_from=3"])


def test_a_recipe_sets_softmax_by(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("extends: lizard\ndistill:\n  softmax_by: kl:2\n")
    assert Recipe.load(path).distill_config(tmp_path / "model").softmax_by == "kl:2"
    assert Recipe.load(path, ["distill.softmax_by=even:15"]).distill_config(tmp_path / "model").softmax_by == "even:15"
    trained = Recipe.load(path, ["distill.kl_train_steps=20"]).distill_config(tmp_path / "model")
    assert trained.kl_train_steps == 20 and trained.softmax_by == "kl:2"
    for bad, message in (("foo:2", "RULE one of"), ("kl:x", "whole number"), ("2", "RULE:N")):
        with pytest.raises(RecipeError, match=f"recipe {path}: distill: .*{message}"):
            Recipe.load(path, [f"distill.softmax_by={bad}"])
