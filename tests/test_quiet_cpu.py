"""No noise we cause ourselves (tokenizer clean-up warning, lm-eval's git and logger lines, datasets' bars),
and CPU users told what they are in for: distill's budget, bench kernels' GPU shapes, an undistilled model."""

import subprocess
import sys

import pytest
from tiny_models import TINY_OPTIONS, tiny_teacher

from linearize.cli import main
from linearize.gguf_files import no_bpe_cleanup
from linearize.modeling import undistilled_note
from linearize.train.config import DistillConfig
from linearize.train.distillation import cpu_budget_note


def bpe_tokenizer(**kwargs):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "<unk>": 2}, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **kwargs)


def test_bpe_tokenizers_say_no_cleanup_which_is_what_decoding_does(tmp_path):
    tok = no_bpe_cleanup(bpe_tokenizer(clean_up_tokenization_spaces=True))
    assert tok.clean_up_tokenization_spaces is False
    tok.save_pretrained(tmp_path)
    assert '"clean_up_tokenization_spaces": false' in (tmp_path / "tokenizer_config.json").read_text()
    forced = bpe_tokenizer(clean_up_tokenization_spaces=True,
                           clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    assert no_bpe_cleanup(forced).clean_up_tokenization_spaces is True


@pytest.mark.slow  # ~10 s: imports lm-eval in a fresh process
def test_quiet_lm_eval_silences_git_outside_a_checkout_and_restores_everything(tmp_path):
    code = """
import datasets, logging, lm_eval.evaluator
from linearize.eval.harness import quiet_lm_eval
before = lm_eval.evaluator.get_git_commit_hash
with quiet_lm_eval():
    lm_eval.evaluator.get_git_commit_hash()
    assert not datasets.is_progress_bar_enabled()
    assert logging.getLogger("lm_eval").getEffectiveLevel() == logging.ERROR
assert lm_eval.evaluator.get_git_commit_hash is before and datasets.is_progress_bar_enabled()
"""
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1]),
                               "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "fatal" not in done.stderr and "not a git repository" not in done.stderr


def test_distill_on_a_cpu_says_how_long_the_papers_budget_takes():
    note = cpu_budget_note(DistillConfig(model="smollm2", method="lizard", out="x"), threads=2)
    assert "hours" in note and "--max-tokens" in note and "\n" not in note
    demo = DistillConfig(model="smollm2", method="lizard", out="x", max_tokens=49_152, seq_len=256, batch=4)
    assert cpu_budget_note(demo, threads=2) is None


def test_bench_kernels_without_quick_refuses_gpu_shapes_without_cuda(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "kernels", "--out", str(tmp_path / "bench")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--quick" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "bench").exists()


def test_a_converted_model_says_it_is_not_distilled_and_older_checkpoints_say_nothing():
    import linearize

    model = linearize.convert(tiny_teacher(), "lizard", **TINY_OPTIONS["lizard"])
    assert model.config.linearize["distilled"] is False
    assert "not distilled" in undistilled_note(model.config)
    model.config.linearize = {**model.config.linearize, "distilled": True}
    assert undistilled_note(model.config) is None
    model.config.linearize = {k: v for k, v in model.config.linearize.items() if k != "distilled"}
    assert undistilled_note(model.config) is None  # a checkpoint from before the field
    assert undistilled_note(tiny_teacher().config) is None


def test_generate_notes_an_undistilled_model_on_stderr(tmp_path, capsys):
    from tiny_models import save_tiny_teacher

    teacher = save_tiny_teacher(tmp_path / "teacher")
    out = tmp_path / "lizard"
    assert main(["convert", "--model", str(teacher), "--method", "lizard", "--out", str(out), "--set", "window=8"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt", "hi", "--max-new-tokens", "3"]) == 0
    assert "not distilled" in capsys.readouterr().err
    assert main(["generate", "--model", str(teacher), "--prompt", "hi", "--max-new-tokens", "3"]) == 0
    assert "not distilled" not in capsys.readouterr().err
