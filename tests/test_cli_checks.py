"""The CLI's checks as a new user meets them: lengths past the model's positions, checks made before the
model loads, a typo'd alias, default devices, decimal memory sizes, a bare `linearize`, the error prefixes."""

import re
import socket
from pathlib import Path

import pytest
import torch
from cli_refusals import refused
from tiny_models import TINY_OPTIONS, tiny_teacher, tiny_tokenizer

import linearize
from linearize import loading
from linearize.cli import build_parser, main
from linearize.cli_args import CommandError
from linearize.config import ConfigError
from linearize.serve.command import memory_size

POSITIONS = 64  # the teachers here have this many positions, so a length one past it is cheap to try
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def work(tmp_path, monkeypatch):
    """The current folder: a tiny teacher of POSITIONS positions and a Lizard student of it."""
    monkeypatch.chdir(tmp_path)
    tiny_teacher(max_position_embeddings=POSITIONS).save_pretrained(tmp_path / "teacher")
    tiny_tokenizer().save_pretrained(tmp_path / "teacher")
    assert main(["convert", "--model", "teacher", "--method", "lizard", "--out", "student", "--set", "window=8"]) == 0
    (tmp_path / "text.txt").write_text("the whale swam far and the sea was wide " * 20)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.md").write_text("mine")
    return tmp_path


# 1. A window, chunk or budget longer than the model's positions: refused where it meets the model.

@pytest.mark.parametrize("method,option", [
    ("lizard", "window"), ("lizard", "chunk_size"), ("lolcats", "window"), ("liger", "window"),
    ("liger", "chunk_size"), ("still", "budget"),
])
def test_convert_refuses_a_length_past_the_models_positions(work, capsys, method, option):
    value = POSITIONS + 1
    options = [f"--set={key}={v}" for key, v in {**TINY_OPTIONS[method], option: value}.items()]  # the rest fits
    line = refused(capsys, work, "convert", "--model", "teacher", "--method", method, "--out", "out", *options,
                   names=[f"{option}={value}", str(POSITIONS), "max_position_embeddings"])
    assert line.startswith("linearize: error: ")


def test_convert_takes_a_window_of_exactly_the_models_positions_and_it_generates(work, capsys):
    assert main(["convert", "--model", "teacher", "--method", "lizard", "--out", "wide",
                 "--set", f"window={POSITIONS}", "--set", f"chunk_size={POSITIONS}"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", "wide", "--prompt", "the cat", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_and_eval_refuse_a_set_window_past_the_positions(work, capsys):
    names = [f"window={POSITIONS + 1}", str(POSITIONS)]
    refused(capsys, work, "generate", "--model", "student", "--prompt", "the whale", "--device", "cpu",
            "--set", f"window={POSITIONS + 1}", names=names)
    refused(capsys, work, "eval", "--model", "student", "--tasks", "ppl", "--lengths", "32", "--limit", "1",
            "--text", "text.txt", "--device", "cpu", "--out", "e.json", "--set", f"window={POSITIONS + 1}", names=names)
    assert main(["generate", "--model", "student", "--prompt", "the whale", "--max-new-tokens", "2", "--device", "cpu",
                 "--set", f"window={POSITIONS}"]) == 0


def test_a_checkpoint_saved_with_a_too_long_window_is_refused_when_it_loads(work, capsys):
    config = work / "student" / "config.json"
    config.write_text(config.read_text().replace('"window": 8', f'"window": {POSITIONS * 10}'))
    refused(capsys, work, "generate", "--model", "student", "--prompt", "hi", "--device", "cpu",
            names=["student", f"window={POSITIONS * 10}", str(POSITIONS)])
    # --set gives it a window that fits: the checkpoint is usable again
    assert main(["generate", "--model", "student", "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu",
                 "--set", "window=8"]) == 0


def test_the_library_refuses_the_same_lengths():
    model = tiny_teacher(max_position_embeddings=POSITIONS)
    with pytest.raises(ConfigError, match=f"budget={POSITIONS + 1} .*max_position_embeddings, {POSITIONS}"):
        linearize.convert(model, "still", **{**TINY_OPTIONS["still"], "budget": POSITIONS + 1})
    assert model.config.model_type == "llama"  # refused before anything was swapped
    linearize.convert(model, "still", **TINY_OPTIONS["still"])
    with pytest.raises(ConfigError, match=f"budget={POSITIONS * 2}"):
        linearize.set_inference_options(model, budget=POSITIONS * 2)
    assert model.config.linearize["options"]["budget"] == TINY_OPTIONS["still"]["budget"]


# 2. Flag checks that need no model run before it loads: with a model that is not there, they still speak.

@pytest.mark.parametrize("argv,names", [
    (["convert", "--method", "lizard", "--out", "afile"], "output afile already exists and is a file"),
    (["convert", "--method", "lizard", "--out", "full"], "output full already exists and is a folder that is not"),
    (["convert", "--method", "lizard", "--out", "afile/sub"], "afile is a file"),
    (["convert", "--method", "lizard", "--out", "new", "--set", "bogus=1"], "lizard has no option 'bogus'"),
    (["generate", "--prompt", "hi", "--compile"], "--compile applies to --static"),
    (["generate", "--prompt", "hi", "--static", "--temperature", "0.5"], "--static decodes greedily"),
    (["generate", "--prompt", "hi", "--set", "bogus=1"], "--set bogus: no method can change bogus"),
    (["eval", "--tasks", "ppl", "--out", "e.json", "--limit", "-1"], "--limit"),
    (["eval", "--tasks", "ppl", "--out", "e.json", "--limit", "0"], "--limit"),
])
def test_flag_checks_come_before_the_model_load(work, capsys, argv, names):
    missing = work / "missing-model"  # loading it would fail naming it
    line = refused(capsys, work, argv[0], "--model", missing, *argv[1:], names=names)
    assert "missing-model" not in line


# 3. A typo'd alias.

@pytest.mark.parametrize("spec,hint", [("smolm2", "did you mean smollm2?"), ("Gemma-3", "did you mean gemma3?"),
                                       ("llama", "aliases: smollm2, gemma3")])
def test_a_bare_name_that_is_not_found_names_the_aliases(work, capsys, monkeypatch, spec, hint):
    monkeypatch.setattr(loading, "hub_reachable", lambda: False)

    def not_cached(repo_id, **kwargs):
        raise FileNotFoundError(f"{repo_id} is not in the cache")

    monkeypatch.setattr(loading.huggingface_hub, "snapshot_download", not_cached)
    line = refused(capsys, work, "generate", "--model", spec, "--prompt", "hi", names=[repr(spec), "cannot be reached"])
    assert line.endswith(hint), line


def test_an_org_slash_name_gets_no_alias_hint():
    assert loading.alias_hint("HuggingFaceTB/smolm2") == ""
    assert loading.alias_hint("smollm") == "; did you mean smollm2?"


# 4. serve and generate default to cuda when there is one, as eval and distill do.

@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_serve_and_generate_default_to_cuda_when_available(work, capsys, monkeypatch, verb, cuda):
    seen = {}

    def load_model(spec, **kwargs):
        seen.update(kwargs)
        raise CommandError("stopped at the load")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(loading, "load_model", load_model)
    with socket.socket() as probe:  # a port serve's check can bind
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = {"generate": ["--prompt", "hi"], "serve": ["--port", str(port)]}[verb]
    refused(capsys, work, verb, "--model", "student", *argv, names="stopped at the load")
    assert seen["device"] == ("cuda" if cuda else "cpu")
    assert main([verb, "--help"]) == 0
    assert "default: cuda when available, else cpu" in " ".join(capsys.readouterr().out.split())


# 5. Decimal memory sizes.

def test_kv_memory_takes_decimal_and_binary_units_in_any_case():
    assert [memory_size(t) for t in ("40GB", "40gb", "40 Gb", "1.5TB", "2KB", "3mb", "40GiB", "40gib", "512MIB",
                                     "2kib", "1000", "1000b")] == [
        40 * 10**9, 40 * 10**9, 40 * 10**9, 15 * 10**11, 2000, 3 * 10**6, 40 * 2**30, 40 * 2**30, 512 * 2**20,
        2048, 1000, 1000]
    assert build_parser().parse_args(["serve", "--model", "x", "--kv-memory", "40GB"]).kv_memory == 40 * 10**9


@pytest.mark.parametrize("size", ["40XB", "GB", "-1GB", "0gb", "40 G B"])
def test_kv_memory_refuses_what_is_not_a_size(capsys, size):
    assert main(["serve", "--model", "x", f"--kv-memory={size}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--kv-memory" in lines[0] and repr(size) in lines[0], lines


# 6. `linearize` alone.

@pytest.mark.parametrize("argv", [[], ["--backend", "torch"]])
def test_no_verb_prints_the_usage_with_the_verbs_on_one_line(capsys, argv):
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("linearize: error: a verb is required; usage: linearize ")
    assert "{convert,generate,demo,distill,eval,bench,serve,recipe}" in lines[0]


# 7. The two error prefixes, as docs/setup.md describes them.

def test_error_prefixes_are_the_ones_setup_md_states(work, capsys):
    flag_error = refused(capsys, work, "convert", "--model", "teacher", "--method", "mamba", "--out", "o", names="mamba")
    run_error = refused(capsys, work, "convert", "--model", "teacher", "--method", "lizard", "--out", "afile",
                        names="afile")
    assert re.match(r"linearize convert: error: ", flag_error) and re.match(r"linearize: error: ", run_error)
    doc = " ".join((ROOT / "docs" / "setup.md").read_text().split())
    assert "`linearize VERB: error: ...` for a flag the parser refuses" in doc
    assert "`linearize: error: ...` for what the verb finds wrong once it runs" in doc


def test_out_of_gpu_memory_is_one_line_with_what_needs_less(monkeypatch, capsys):
    """Torch's message runs to several lines of per-process figures; the user gets what was asked for and
    free, and the settings that shrink a micro-batch. Exit 1: not bad input."""
    from linearize.train import command

    def out_of_memory(args):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which "
            "681.88 MiB is free. Including non-PyTorch memory, this process has 40.21 GiB memory in use. Process "
            "1028 has 8.24 GiB memory in use.\nOf the allocated memory 38.59 GiB is allocated by PyTorch")

    monkeypatch.setattr(command, "run", out_of_memory)
    assert main(["distill", "--model", "m", "--method", "lizard", "--out", "o"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("linearize: error: out of GPU memory (Tried to allocate 1024.00 MiB.")
    assert "681.88 MiB is free" in err and "Process 1028" not in err and "--grad-accum" in err
    monkeypatch.setenv("LINEARIZE_DEBUG", "1")
    with pytest.raises(torch.OutOfMemoryError):
        main(["distill", "--model", "m", "--method", "lizard", "--out", "o"])


def test_a_missing_dependency_is_one_line(monkeypatch, capsys):
    """A package linearize imports when it needs it (gguf, for the GGUF teachers) missing from the install:
    the package named, and how to mend it; exit 1, not bad input."""
    from linearize.train import command

    def missing(args):
        raise ModuleNotFoundError("No module named 'gguf'", name="gguf")

    monkeypatch.setattr(command, "run", missing)
    assert main(["distill", "--model", "m", "--method", "lizard", "--out", "o"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("linearize: error: the package 'gguf' is not installed")
    monkeypatch.setenv("LINEARIZE_DEBUG", "1")
    with pytest.raises(ModuleNotFoundError):
        main(["distill", "--model", "m", "--method", "lizard", "--out", "o"])


def test_other_errors_still_raise(monkeypatch):
    from linearize.train import command

    def broken(args):
        raise RuntimeError("a bug, not a GPU's memory")

    monkeypatch.setattr(command, "run", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["distill", "--model", "m", "--method", "lizard", "--out", "o"])


# 8. What a command prints at its end: the eval summary's average, the demo's figures.

def test_the_eval_summary_shows_the_numbers_its_zero_shot_average_is_made_of():
    from linearize.eval.command import summary_line

    metrics = {"piqa": "acc", "arc_easy": "acc", "arc_challenge": "acc_norm", "hellaswag": "acc_norm",
               "winogrande": "acc"}
    tasks = {name: {"acc": 0.3, "acc_norm": 0.9} for name in metrics}
    average = sum(tasks[name][metric] for name, metric in metrics.items()) / len(metrics)
    line = summary_line({"tasks": tasks, "zeroshot_average": {"value": average, "metrics": metrics}})
    shown = [float(part.split("=")[1]) for part in line.split() if not part.startswith("zeroshot_avg")]
    assert sum(shown) / len(shown) == pytest.approx(float(line.split("zeroshot_avg=")[1]), abs=1e-3)
    assert "arc_challenge:acc_norm=0.900" in line and "piqa=0.300" in line


def test_the_demo_ends_with_the_figures_the_readme_quotes_and_its_folder(tmp_path):
    import json

    from linearize.cli import demo_summary

    log = [{"stage": 1, "split": "val", "val_loss": 1.65}, {"stage": 1, "step": 1, "loss": 2.0},
           {"stage": 1, "split": "val", "val_loss": 0.56}, {"stage": 2, "split": "val", "val_loss": 3.75},
           {"stage": 2, "split": "val", "val_loss": 3.54}]
    (tmp_path / "train_log.jsonl").write_text("\n".join(json.dumps(r) for r in log))
    text = demo_summary(tmp_path, {"teacher": 65.0, "lizard student": 86.0})
    assert "stage-1 MSE 1.65 -> 0.56, stage-2 loss 3.75 -> 3.54, perplexity 86.0 against the teacher's 65.0" in text
    assert str(tmp_path) in text.splitlines()[-1]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "--max-tokens 49152 --seq-len 256 --batch 4" in readme  # the CPU-sized distill beside the quickstart's
