"""The CLI contract: flags, outputs, and one-line errors that leave nothing behind."""

import json

import pytest
import torch
from tiny_models import save_tiny_teacher, tiny_tokenizer
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from linearize.cli import main
from linearize.loading import load_model


@pytest.fixture
def teacher_dir(tmp_path):
    return save_tiny_teacher(tmp_path / "teacher")


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_convert_writes_a_loadable_model(teacher_dir, tmp_path, capsys):
    out = tmp_path / "lizard"
    code, _, err = run(capsys, "convert", "--model", teacher_dir, "--method", "lizard", "--out", out,
                       "--softmax-layers", "1", "--set", "window=8", "--set", "gate=vector")
    assert code == 0, err
    model = load_model(out)
    assert model.config.linearize["options"]["window"] == 8
    assert model.config.linearize["options"]["gate"] == "vector"
    assert model.config.linearize["softmax_layers"] == [1]
    same = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(3, 100, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, same(ids).logits)
    code, text, err = run(capsys, "generate", "--model", out, "--prompt", "hello", "--max-new-tokens", "5")
    assert code == 0, err
    assert len(tiny_tokenizer()(text.rstrip("\n"))["input_ids"]) <= 5


def test_static_generation_gives_hf_generates_greedy_text(teacher_dir, tmp_path, capsys):
    """`generate --static` (greedy steps on the frozen cache) writes what HF's greedy `generate` writes;
    it refuses a model whose cache grows (the teacher), sampling, and --compile without --static."""
    out = tmp_path / "lizard"
    assert run(capsys, "convert", "--model", teacher_dir, "--method", "lizard", "--out", out, "--set", "window=8")[0] == 0
    prompt = ["--prompt", "the cat sat on the mat", "--max-new-tokens", "12"]
    code, hf_text, err = run(capsys, "generate", "--model", out, *prompt)
    assert code == 0, err
    code, static_text, err = run(capsys, "generate", "--model", out, *prompt, "--static")
    assert code == 0, err
    assert static_text == hf_text and hf_text.strip()
    for argv, needle in ((["--model", teacher_dir, "--static"], "fully linearized"),
                         (["--model", out, "--static", "--temperature", "0.7"], "decodes greedily"),
                         (["--model", out, "--compile"], "applies to --static")):
        code, _, err = run(capsys, "generate", *argv, *prompt)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv,needle", [
    (["--method", "mamba"], "invalid choice"),
    (["--method", "lizard", "--set", "window=0"], "window must be > 0"),
    (["--method", "lizard", "--set", "gate=sideways"], "gate must be one of"),
    (["--method", "lizard", "--set", "bogus=1"], "no option 'bogus'"),
    (["--method", "still", "--set", "window=32", "--set", "chunk_size=64"], "window (32) must be >= chunk_size"),
    (["--method", "lizard", "--softmax-layers", "0,7"], "out of range"),
])
def test_bad_options_fail_in_one_line_and_write_nothing(teacher_dir, tmp_path, capsys, argv, needle):
    out = tmp_path / "out"
    code, _, err = run(capsys, "convert", "--model", teacher_dir, "--out", out, *argv)
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == [teacher_dir]


def test_eval_and_generate_set_inference_options_of_a_still_model(teacher_dir, tmp_path, capsys):
    student = tmp_path / "still"
    code, _, err = run(capsys, "convert", "--model", teacher_dir, "--method", "still", "--out", student,
                       "--set", "window=8", "--set", "budget=14", "--set", "chunk_size=4", "--set", "max_chunks=2")
    assert code == 0, err
    text = tmp_path / "text.txt"
    text.write_text("the whale swam far and the sea was wide " * 40)
    out = tmp_path / "eval.json"
    common = ("eval", "--model", student, "--tasks", "ppl", "--lengths", "64", "--limit", "1", "--text", text,
              "--device", "cpu", "--out", out)
    code, _, err = run(capsys, *common, "--set", "budget=32", "--set", "routing=recency")
    assert code == 0, err
    options = json.loads(out.read_text())["provenance"]["method_config"]["options"]
    assert (options["budget"], options["routing"], options["window"]) == (32, "recency", 8)
    code, _, err = run(capsys, *common, "--overwrite", "--set", "window=4")
    assert code == 2 and "still cannot change window after training" in err and len(err.strip().splitlines()) == 1
    code, text, err = run(capsys, "generate", "--model", student, "--prompt", "hello", "--max-new-tokens", "4",
                          "--set", "budget=32")
    assert code == 0 and text.strip(), err
    code, _, err = run(capsys, "generate", "--model", student, "--prompt", "hello", "--set", "gate=false")
    assert code == 2 and "no method can change gate after training" in err and len(err.strip().splitlines()) == 1


def test_missing_model_path(tmp_path, capsys):
    code, _, err = run(capsys, "convert", "--model", tmp_path / "nope", "--method", "lizard", "--out", tmp_path / "o")
    assert code == 2 and "nope" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_unsupported_architecture(tmp_path, capsys):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128)).save_pretrained(tmp_path / "gpt2")
    tiny_tokenizer().save_pretrained(tmp_path / "gpt2")
    code, _, err = run(capsys, "convert", "--model", tmp_path / "gpt2", "--method", "lizard", "--out", tmp_path / "o")
    assert code == 2 and "gpt2" in err and "llama" in err and "mistral" in err and "qwen2" in err
    assert not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["gpt2"]


def test_unwritable_out(teacher_dir, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = run(capsys, "convert", "--model", teacher_dir, "--method", "lizard", "--out", blocker / "sub")
    assert code == 2 and f"{blocker} is a file" in err
    code, _, err = run(capsys, "convert", "--model", teacher_dir, "--method", "lizard", "--out", blocker)
    assert code == 2 and "already exists" in err


@pytest.mark.slow
def test_real_teacher_converts_to_lizard_and_generates(tmp_path):
    from linearize import convert
    from linearize.cli import generate_text
    from linearize.loading import load_tokenizer

    model, tokenizer = load_model("smollm2"), load_tokenizer("smollm2")
    convert(model, "lizard")
    assert len(model.model.layers) == 30
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8
    assert isinstance(generate_text(model, tokenizer, "Hi", max_new_tokens=8, chat=True), str)


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    from linearize import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    code, _, err = run(capsys, "generate", "--model", "x", "--prompt", "hi")
    assert code == 130 and err.strip() == "linearize: interrupted"


def test_sigterm_is_a_clean_stop_exit_143_and_the_callers_handler_comes_back(monkeypatch, capsys):
    """A SIGTERM (a scheduler's stop, `kill`) raises `cli.Terminated`, a KeyboardInterrupt: the command
    stops the way Ctrl-C stops it, and exits 128 + 15. A process calling `main` gets its handler back."""
    import signal

    from linearize import cli

    def terminated(args):
        assert signal.getsignal(signal.SIGTERM) is cli._raise_terminated
        signal.raise_signal(signal.SIGTERM)
        pytest.fail("the SIGTERM was not raised")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli, "cmd_generate", terminated)
    code, _, err = run(capsys, "generate", "--model", "x", "--prompt", "hi")
    assert code == 143 and err.strip() == "linearize: terminated"
    assert issubclass(cli.Terminated, KeyboardInterrupt) and signal.getsignal(signal.SIGTERM) is before


def test_a_sigint_reaches_a_command_started_with_it_ignored(monkeypatch, capsys):
    """A shell starts background commands with SIGINT ignored; the CLI listens again, so a time limit's
    SIGINT interrupts the command the clean way (exit 130) instead of being dropped."""
    import signal

    from linearize import cli

    def wait_for_the_signal(args):
        signal.raise_signal(signal.SIGINT)
        pytest.fail("the SIGINT was ignored")

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        monkeypatch.setattr(cli, "cmd_generate", wait_for_the_signal)
        code, _, err = run(capsys, "generate", "--model", "x", "--prompt", "hi")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130 and err.strip() == "linearize: interrupted"
