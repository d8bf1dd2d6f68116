"""The README's promise for bad input, case by case (issue 37): exit status 2, one line on stderr that
names the input, no traceback, and nothing written, left behind or touched; paper cuts that now work."""

import json
import os
import stat
import struct

import pytest
import torch
from cli_refusals import listing, refused
from tiny_models import save_tiny_teacher

from linearize.cli import main
from linearize.config import METHOD_CONFIGS, ConfigError, make_method_config

TRAIN = ["--max-tokens", "64", "--seq-len", "32", "--batch", "2", "--save-every", "1", "--eval-every", "1"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder of inputs, the current directory of the command: a tiny teacher, data, broken files."""
    monkeypatch.chdir(tmp_path)
    save_tiny_teacher(tmp_path / "teacher")
    (tmp_path / "data.txt").write_text(" ".join(["the cat sat on the mat and ran to the sea"] * 60))
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "empty.gguf").write_bytes(b"")
    # A GGUF v3 header that promises 1 tensor and 5 metadata entries, then ends.
    (tmp_path / "truncated.gguf").write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, 1, 5) + b"\x09\x00")
    for name, weights in (("cut", (tmp_path / "teacher" / "model.safetensors").read_bytes()[:100]),
                          ("garbage", os.urandom(4000))):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text((tmp_path / "teacher" / "config.json").read_text())
        (folder / "tokenizer.json").write_text((tmp_path / "teacher" / "tokenizer.json").read_text())
        (folder / "model.safetensors").write_bytes(weights)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("my notes")
    return tmp_path


# Tracebacks before: corrupt model files, a CUDA device that is not there, an empty prompt.

@pytest.mark.parametrize("model", ["truncated.gguf", "empty.gguf"])
def test_a_truncated_or_empty_gguf_is_named(work, capsys, model):
    refused(capsys, work, "convert", "--model", model, "--method", "lizard", "--out", "out", names=model)
    refused(capsys, work, "eval", "--model", model, "--tasks", "ppl", "--out", "r.json", "--lengths", "64",
            "--limit", "1", "--text", "data.txt", "--device", "cpu", names=model)
    refused(capsys, work, "distill", "--model", model, "--method", "lizard", "--out", "run", "--data", "data.txt",
            *TRAIN, names=model)


@pytest.mark.parametrize("model", ["cut", "garbage"])
def test_truncated_or_garbage_safetensors_are_named(work, capsys, model):
    line = refused(capsys, work, "convert", "--model", model, "--method", "lizard", "--out", "out",
                   names=f"{model}/model.safetensors")
    assert "truncated or corrupt" in line
    refused(capsys, work, "generate", "--model", model, "--prompt", "hi", names=f"{model}/model.safetensors")


@NO_CUDA
def test_device_cuda_without_cuda_is_refused_up_front(work, capsys):
    cuda = "--device cuda: no CUDA device here"
    refused(capsys, work, "generate", "--model", "teacher", "--prompt", "hi", "--device", "cuda", names=cuda)
    refused(capsys, work, "eval", "--model", "teacher", "--tasks", "ppl", "--out", "r.json", "--lengths", "64",
            "--limit", "1", "--text", "data.txt", "--device", "cuda", names=cuda)
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run",
            "--data", "data.txt", *TRAIN, "--device", "cuda", names=cuda)
    refused(capsys, work, "generate", "--model", "teacher", "--prompt", "hi", "--device", "gpu", names="--device gpu")


def test_an_empty_prompt_is_refused(work, capsys):
    refused(capsys, work, "generate", "--model", "teacher", "--prompt", "", names="--prompt")


# Nonsense accepted before.

@pytest.mark.parametrize("option", ["gate_temperature=nan", "eps=nan", "eps=inf", "gate_temperature=-inf",
                                    "gate_bias_init=inf", "alpha_init=nan"])
def test_nan_and_inf_options_are_refused(work, capsys, option):
    refused(capsys, work, "convert", "--model", "teacher", "--method", "lizard", "--out", "out", "--set", option,
            names=option.partition("=")[0])


def test_every_float_option_of_every_method_refuses_nan_and_inf():
    for method, cls in METHOD_CONFIGS.items():
        for name, value in vars(cls()).items():
            if isinstance(value, float):
                for bad in ("nan", "inf", "-inf"):
                    with pytest.raises(ConfigError, match=name):
                        make_method_config(method, **{name: bad})


def test_softmax_layers_that_leave_no_linear_layer_are_refused(work, capsys):
    # The tiny teacher has 2 layers.
    refused(capsys, work, "convert", "--model", "teacher", "--method", "lizard", "--out", "out",
            "--softmax-layers", "0,1", names="no layer left to linearize")
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run", "--data", "data.txt",
            *TRAIN, "--softmax-layers", "0,1", names="no layer left to linearize")
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run", "--data", "data.txt",
            *TRAIN, "--softmax-by", "error:2", names="--softmax-by error:2")
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run", "--data", "data.txt",
            *TRAIN, "--softmax-layers", "1", "--softmax-by", "error:1", names="--softmax-by error:1")


@pytest.mark.parametrize("value", ["-0.1", "1", "1.5", "nan", "a fifth", ""])
def test_a_recall_share_outside_zero_to_one_is_refused_by_its_flag(work, capsys, value):
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run", "--data", "data.txt",
            *TRAIN, "--recall-share", value, names="--recall-share")


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "far", ""])
def test_a_far_weight_below_zero_or_not_a_number_is_refused_by_its_flag(work, capsys, value):
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run", "--data", "data.txt",
            *TRAIN, "--far-weight", value, names="--far-weight")


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_negative_or_non_finite_temperature_is_refused(work, capsys, value):
    refused(capsys, work, "generate", "--model", "teacher", "--prompt", "hi", "--temperature", value,
            names="--temperature")


@pytest.mark.parametrize("verb", [["generate", "--prompt", "hi"], ["eval", "--tasks", "ppl", "--out", "e.json"],
                                  ["distill", "--method", "lizard", "--out", "run"]])
def test_a_seed_out_of_range_is_refused_by_flag(work, capsys, verb):
    """A seed past 2**63 is refused by its flag, before torch would fail to unpack it."""
    refused(capsys, work, verb[0], "--model", "teacher", *verb[1:], "--seed", "99999999999999999999", names="--seed")


@pytest.mark.parametrize("flags,names", [
    (["--head-lr-scale", "nan"], "head_lr_scale"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "1e-3,inf"], "--lr"),
])
def test_distill_refuses_non_finite_rates(work, capsys, flags, names):
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run", "--data", "data.txt",
            *TRAIN, *flags, names=names)


def test_eval_out_must_be_a_json_file(work, capsys):
    common = ["--tasks", "ppl", "--lengths", "64", "--limit", "1", "--text", "data.txt", "--device", "cpu"]
    refused(capsys, work, "eval", "--model", "teacher", "--out", "b.txt", *common, names="--out b.txt")
    refused(capsys, work, "eval", "--model", "teacher", "--out", "mine", *common, names="--out mine is a folder")
    refused(capsys, work, "eval", "--model", "teacher", "--out", "afile/r.json", *common, names="afile is a file")


# Lost or overwritten work.

def test_an_empty_out_is_refused_not_taken_for_the_current_folder(work, capsys):
    refused(capsys, work, "convert", "--model", "teacher", "--method", "lizard", "--out", "", names="--out is empty")
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "", "--data", "data.txt",
            *TRAIN, names="--out is empty")
    refused(capsys, work, "eval", "--model", "teacher", "--tasks", "ppl", "--out", "", "--lengths", "64",
            "--limit", "1", "--text", "data.txt", "--device", "cpu", names="--out is empty")


def test_distill_refuses_a_folder_that_is_not_a_run(work, capsys):
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "mine", "--data", "data.txt",
            *TRAIN, names="output mine already exists")
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "afile", "--data",
            "data.txt", *TRAIN, names="output afile already exists and is a file")
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "afile/run", "--data",
            "data.txt", *TRAIN, names="afile is a file")


def test_eval_refuses_an_existing_results_file_before_any_task(work, capsys):
    (work / "r.json").write_text('{"mine": true}')
    common = ["--tasks", "ppl", "--lengths", "64", "--limit", "1", "--text", "data.txt", "--device", "cpu"]
    line = refused(capsys, work, "eval", "--model", "teacher", "--out", "r.json", *common, names="--out r.json")
    assert "--overwrite" in line and "--resume" in line
    refused(capsys, work, "eval", "--model", "teacher", "--out", "r.json", "--resume", "--overwrite", *common,
            names="pick one")
    assert main(["eval", "--model", "teacher", "--out", "r.json", "--overwrite", *common]) == 0
    assert '"mine"' not in (work / "r.json").read_text()
    assert not list(work.glob("*.tmp"))


# The trap: checks that came after distill_config.json was written.

@pytest.mark.parametrize("flags,names", [
    (["--method", "lizard", "--softmax-layers", "5"], "--softmax-layers 5"),
    (["--method", "liger", "--stage", "1"], "liger"),
    pytest.param(["--method", "lizard", "--device", "cuda"], "--device cuda", marks=NO_CUDA),
])
def test_distill_checks_everything_before_writing(work, capsys, flags, names):
    refused(capsys, work, "distill", "--model", "teacher", "--out", "run", "--data", "data.txt", *TRAIN, *flags,
            names=names)
    assert not (work / "run").exists()


def test_distilling_a_linearized_model_is_refused_before_the_run_is_written(work, capsys):
    """Refused on the teacher's config, before distill_config.json exists: the retry with the teacher
    must not find a folder that "already holds a run"."""
    assert main(["convert", "--model", "teacher", "--method", "lizard", "--out", "student"]) == 0
    capsys.readouterr()
    refused(capsys, work, "distill", "--model", "student", "--method", "lizard", "--out", "dz", "--data", "data.txt",
            *TRAIN, names="the model is already linearized (lizard); convert its teacher instead")
    assert not (work / "dz").exists()


def test_distilling_with_a_window_past_the_models_positions_is_refused_before_the_run_is_written(work, capsys):
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "dz", "--data", "data.txt",
            *TRAIN, "--set", "window=100000", names="window=100000 is larger than the model's max_position_embeddings")
    assert not (work / "dz").exists()


def test_distilling_an_architecture_convert_does_not_take_is_refused_before_the_run_is_written(work, capsys):
    (work / "other").mkdir()
    config = json.loads((work / "teacher" / "config.json").read_text())
    (work / "other" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2", "architectures": None}))
    (work / "other" / "tokenizer.json").write_text((work / "teacher" / "tokenizer.json").read_text())
    refused(capsys, work, "distill", "--model", "other", "--method", "lizard", "--out", "dz", "--data", "data.txt",
            *TRAIN, names="cannot linearize model type 'gpt2'")
    assert not (work / "dz").exists()


def test_a_fixed_distill_reruns_and_resuming_a_finished_run_says_so(work, capsys):
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run", "--data", "data.txt",
            *TRAIN, "--stage", "1", "--softmax-layers", "7", names="--softmax-layers 7")
    argv = ["distill", "--model", "teacher", "--method", "lizard", "--out", "run", "--data", "data.txt", *TRAIN,
            "--stage", "1"]
    assert main(argv) == 0
    assert "written to run" in capsys.readouterr().out
    before = listing(work)
    assert main([*argv, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "already holds the finished" in out and "written" not in out
    assert listing(work) == before  # nothing re-exported


# Paper cuts.

def test_convert_makes_missing_parents_with_normal_permissions(work, capsys):
    old = os.umask(0o022)
    try:
        assert main(["convert", "--model", "teacher", "--method", "lizard", "--out", "runs/deep/lizard"]) == 0
    finally:
        os.umask(old)
    out = work / "runs" / "deep" / "lizard"
    assert (out / "config.json").is_file()
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in out.iterdir())
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".partial")]


def test_convert_leaves_no_parents_it_made_when_it_fails(work, capsys):
    refused(capsys, work, "convert", "--model", "cut", "--method", "lizard", "--out", "runs/deep/lizard",
            names="cut/model.safetensors")
    assert not (work / "runs").exists()


def test_an_out_under_a_file_says_the_file_is_a_file(work, capsys):
    refused(capsys, work, "convert", "--model", "teacher", "--method", "lizard", "--out", "afile/sub",
            names="afile is a file")


def test_generate_static_on_a_model_with_softmax_layers_names_no_internal_class(work, capsys):
    line = refused(capsys, work, "generate", "--model", "teacher", "--prompt", "hi", "--static",
                   names="fully linearized")
    assert "StaticDecoder" not in line


def test_too_little_data_is_refused_before_the_run_is_written(work, capsys):
    (work / "tiny.txt").write_text("the cat sat on the mat and ran to the sea")
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run",
            "--data", "tiny.txt", *TRAIN, names="tiny.txt")


@pytest.mark.parametrize("content", ["", '{"model": "teacher", "method"', '{"nonsense": 1}'])
def test_resume_with_a_broken_run_config_names_it(work, capsys, content):
    (work / "run").mkdir()
    (work / "run" / "distill_config.json").write_text(content)
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run", "--data", "data.txt",
            *TRAIN, "--resume", names="run/distill_config.json")


def test_binary_text_data_is_named(work, capsys):
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run",
            "--data", "binary.txt", *TRAIN, names="binary.txt")


@pytest.mark.parametrize("content", [b"[]", b"null", b"\xff\xfe not json"])
def test_a_model_config_that_is_not_a_json_object_is_named(work, capsys, content):
    """A config.json that is not a JSON object is named, not handed to transformers to index."""
    (work / "teacher" / "config.json").write_bytes(content)
    refused(capsys, work, "generate", "--model", "teacher", "--prompt", "hi", names="config.json")


def test_an_unusable_cache_folder_names_linearize_cache(work, capsys, monkeypatch):
    # /proc takes no new folders: the model alias's dense copy has nowhere to go.
    monkeypatch.setenv("LINEARIZE_CACHE", "/proc/x")
    line = refused(capsys, work, "generate", "--model", "smollm2", "--prompt", "hi", names=["LINEARIZE_CACHE", "/proc/x"])
    assert "cannot make the asset cache" in line


def test_a_size_option_past_int32_is_refused(work, capsys):
    """window=1e20 is refused as an option, never reaching torch.zeros as a shape."""
    assert main(["convert", "--model", "teacher", "--method", "lizard", "--out", "student"]) == 0
    capsys.readouterr()
    refused(capsys, work, "generate", "--model", "student", "--prompt", "hi", "--set", "window=99999999999999999999",
            names="window")


def refused_recipe(capsys, work, *, data: str, tasks: str, names: str):
    """`refused` for `recipe run` of a tiny one-stage row of the teacher on `data`, evaluated on `tasks`."""
    (work / "r.yaml").write_text("model: teacher\ndistill:\n  method: lizard\n  stage: '1'\n  max_tokens: 64\n"
                                 f"  seq_len: 32\n  batch: 2\n  data: {data}\neval:\n  tasks: {tasks}\n")
    refused(capsys, work, "recipe", "run", "r.yaml", "--out", "runs", "--device", "cpu", names=names)


def test_a_recipe_refused_at_its_start_leaves_no_run_folder(work, capsys):
    """A recipe whose data path is wrong leaves no OUT/<name>/run.json behind."""
    refused_recipe(capsys, work, data="nowhere.txt", tasks="ppl", names="nowhere.txt")


def test_a_config_that_does_not_match_the_weights_is_named(work, capsys):
    """A config.json whose sizes do not match the weights is named in one line, not transformers' report."""
    config = json.loads((work / "teacher" / "config.json").read_text())
    config["intermediate_size"] *= 2
    (work / "teacher" / "config.json").write_text(json.dumps(config))
    refused(capsys, work, "convert", "--model", "teacher", "--method", "lizard", "--out", "student",
            names="config.json")


def test_a_recipe_with_a_bad_eval_task_is_refused_before_it_trains(work, capsys):
    """A truncated task name is refused before the row trains, not after."""
    refused_recipe(capsys, work, data="data.txt", tasks="pp", names="r.yaml")


@pytest.mark.parametrize("override, names", [
    ("eval.lengths=5x", "r.yaml: eval: Bad length '5x'"),
    ("eval.depths=[50, 200]", "r.yaml: eval: Bad depth '200'"),
    ("eval.task_lengths=4k", "r.yaml: eval: task lengths must be a mapping"),
])
def test_a_recipe_distilled_without_eval_still_has_its_eval_checked_first(work, capsys, override, names):
    """`--no-eval` trains now for a later evaluation: a bad eval section is refused before the training."""
    (work / "r.yaml").write_text("model: teacher\ndistill:\n  method: lizard\n  stage: '1'\n  max_tokens: 64\n"
                                 "  seq_len: 32\n  batch: 2\n  data: data.txt\neval:\n  tasks: ppl\n")
    refused(capsys, work, "recipe", "run", "r.yaml", override, "--out", "runs", "--device", "cpu", "--no-eval",
            names=names)
    assert not (work / "runs").exists()


@pytest.mark.parametrize("flags,names", [
    (["--softmax-by", "kl:x"], "--softmax-by"),
    (["--softmax-by", "foo:2"], "--softmax-by"),
    (["--softmax-by", "kl:0"], "--softmax-by"),
    (["--softmax-by", "kl"], "--softmax-by"),
    # The tiny teacher has 2 layers: N must leave one linear.
    (["--softmax-by", "kl:2"], "--softmax-by kl:2: the model has 2 linearized layer(s)"),
    (["--softmax-by", "even:2"], "--softmax-by even:2"),
    (["--softmax-layers", "0", "--softmax-by", "error:1"], "--softmax-by error:1: the model has 1 linearized"),
    # kl and error rank the layers after stage 1.
    (["--softmax-by", "kl:1", "--stage", "1"], "softmax_by kl:1"),
    (["--softmax-by", "error:1", "--stage", "2"], "softmax_by error:1"),
])
def test_bad_softmax_by_is_refused(work, capsys, flags, names):
    refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run", "--data", "data.txt",
            *TRAIN, *flags, names=names)


# The second trial (issue 69): undecodable argv, lengths and budgets that train nothing, recipe overrides,
# a tokenizer without its vocabulary, an unwritable --out, a run stopped before its first step, file modes.

@pytest.mark.parametrize("flags", [["--prompt", "\udcff\udcfe bad bytes"], ["--chat", "--prompt", "caf\udce9"]])
def test_a_prompt_that_is_not_utf8_is_refused_by_flag(work, capsys, flags):
    """Bytes that are not UTF-8 reach Python's argv as lone surrogates, which no tokenizer takes."""
    line = refused(capsys, work, "generate", "--model", "teacher", *flags, names=["--prompt", "UTF-8"])
    assert "byte 0x" in line


@pytest.mark.parametrize("method,flags,names", [
    ("lizard", ["--seq-len", "1"], ["--seq-len", "1", "window"]),
    ("lolcats", ["--seq-len", "8", "--set", "window=8"], ["--seq-len", "8", "window (8)"]),
])
def test_a_sequence_length_that_trains_nothing_is_refused(work, capsys, method, flags, names):
    train = [x for x in TRAIN if x not in ("--seq-len", "32")]
    refused(capsys, work, "distill", "--model", "teacher", "--method", method, "--out", "run", "--data", "data.txt",
            *train, *flags, names=names)
    assert not (work / "run").exists()


def test_a_token_budget_below_one_batch_names_max_tokens_not_the_data(work, capsys):
    line = refused(capsys, work, "distill", "--model", "teacher", "--method", "lizard", "--out", "run",
                   "--data", "data.txt", "--max-tokens", "100", "--seq-len", "32", "--batch", "8",
                   names=["--max-tokens", "256"])
    assert "--data" not in line and "data.txt" not in line


def test_a_recipe_override_of_the_wrong_type_names_its_key_and_value(work, capsys):
    (work / "r.yaml").write_text("model: teacher\ndistill:\n  method: lizard\n  stage: '1'\n  max_tokens: 64\n"
                                 "  seq_len: 32\n  batch: 2\n  data: data.txt\neval:\n  tasks: ppl\n")
    refused(capsys, work, "recipe", "run", "r.yaml", "distill.max_tokens=lots", "--out", "runs", "--device", "cpu",
            names=["max_tokens", "'lots'", "distill.max_tokens=lots"])
    assert not (work / "runs").exists()


def test_every_per_task_setting_that_conflicts_is_named_at_once(work, capsys):
    (work / "r.yaml").write_text("model: teacher\ndistill:\n  method: lizard\n  stage: '1'\n  max_tokens: 64\n"
                                 "  seq_len: 32\n  batch: 2\n  data: data.txt\neval:\n  tasks: ppl,passkey,mmlu\n"
                                 "  task_lengths:\n    passkey: 64\n  task_limits:\n    mmlu: 2\n")
    refused(capsys, work, "recipe", "run", "r.yaml", "eval.tasks=ppl", "--out", "runs", "--device", "cpu",
            names=["eval.task_lengths=null", "eval.task_limits=null", "'passkey'", "'mmlu'"])


def test_a_tokenizer_config_without_its_vocabulary_is_named(work, capsys):
    (work / "teacher" / "tokenizer.json").unlink()
    line = refused(capsys, work, "generate", "--model", "teacher", "--prompt", "hi",
                   names=["teacher", "tokenizer_config.json", "no vocabulary"])
    assert line.rstrip().endswith("folder"), line  # the whole reason, not a list cut at its first line


def test_eval_into_a_read_only_folder_is_refused_before_any_work(work, capsys, monkeypatch):
    (work / "ro").mkdir()
    (work / "ro").chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: the check is made to see the folder's mode as a user would
        real = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: real(path, mode) and (
            not mode & os.W_OK or bool(os.stat(path).st_mode & stat.S_IWUSR)))
    loads = []
    monkeypatch.setattr("linearize.loading.load_tokenizer", lambda *a, **k: loads.append(a))
    refused(capsys, work, "eval", "--model", "teacher", "--tasks", "ppl", "--out", "ro/r.json", "--lengths", "64",
            "--limit", "1", "--text", "data.txt", "--device", "cpu", names=["ro", "not writable"])
    assert not loads


def test_distill_writes_its_model_with_normal_permissions(work, capsys):
    old = os.umask(0o022)
    try:
        assert main(["distill", "--model", "teacher", "--method", "lizard", "--out", "run", "--data", "data.txt",
                     *TRAIN, "--stage", "1"]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((work / "run" / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((work / "run" / "config.json").stat().st_mode) == 0o644
