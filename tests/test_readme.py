"""The README's Python quickstart runs as written, on a tiny teacher in place of SmolLM2."""

import re
from pathlib import Path

import torch
from tiny_models import save_tiny_teacher

README = Path(__file__).resolve().parents[1] / "README.md"


def python_quickstart() -> str:
    section = README.read_text().split("## Quickstart: Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_python_quickstart_runs_and_both_decodes_agree(tmp_path, monkeypatch):
    code = python_quickstart()
    assert '"smollm2"' in code and '"runs/lizard"' in code
    teacher = save_tiny_teacher(tmp_path / "teacher")
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code.replace('"smollm2"', repr(str(teacher))), str(README), "exec"), namespace)  # noqa: S102 (the README's own code)
    # What the snippet built: a saved checkpoint with its tokenizer, and two greedy continuations.
    assert (tmp_path / "runs" / "lizard" / "config.json").is_file()
    assert (tmp_path / "runs" / "lizard" / "tokenizer.json").is_file()
    prompt = namespace["prompt_ids"]
    new = namespace["ids"][:, -64:]
    generated = namespace["again"].generate(prompt, max_new_tokens=64, do_sample=False)[:, prompt.shape[1]:]
    assert new.shape == generated.shape and torch.equal(new, generated)
