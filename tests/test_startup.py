"""Imports on demand: `import linearize` and the command's parser load neither torch nor transformers,
and the HF convention (`import linearize`, then `AutoModelForCausalLM.from_pretrained(<linearized>)`)
still finds our model types in whichever order the two are imported."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIZARD = ROOT / "tests" / "fixtures" / "checkpoints" / "lizard"
HEAVY = ("torch", "transformers", "sklearn", "lm_eval", "datasets", "matplotlib")


def python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def heavy_modules_after(code: str) -> list[str]:
    out = python(f"import json, sys\n{code}\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    return json.loads(out.strip().splitlines()[-1])


def test_import_linearize_imports_neither_torch_nor_transformers():
    assert heavy_modules_after("import linearize") == []


@pytest.mark.parametrize("argv", [["--help"], ["convert", "--help"], ["distill", "--help"], ["eval", "--help"],
                                  ["generate", "--help"], ["bench", "kernels", "--help"], ["recipe", "run", "--help"],
                                  ["demo", "--help"], ["convert", "--no-such-flag"], ["no-such-verb"]])
def test_parsing_help_or_a_bad_flag_imports_nothing_heavy(argv):
    code = f"from linearize.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    assert heavy_modules_after(code) == []


@pytest.mark.slow
def test_public_names_and_submodules_load_on_first_use():
    """`linearize.__all__` resolves lazily, and `import linearize` then `linearize.decode.greedy_decode` (the
    README's quickstart) works: one interpreter for both, as each start imports torch."""
    out = python("import linearize, types\n"
                 "print(linearize.decode.greedy_decode.__name__, linearize.ops.backend.get_backend(),"
                 " hasattr(linearize, 'no_such_name'))\n"
                 "names = [n for n in linearize.__all__ if getattr(linearize, n) is None]\n"
                 "import linearize.convert\n"
                 "print(names, isinstance(linearize.convert, types.FunctionType), set(linearize.__all__) <= set(dir(linearize)))")
    assert out.split() == ["greedy_decode", "auto", "False", "[]", "True", "True"]


FROM_PRETRAINED = f"\nm = AutoModelForCausalLM.from_pretrained({str(LIZARD)!r})\nprint(type(m).__name__)"


# A fresh interpreter each (~5 s): `make test-all`. In process, the README test loads a checkpoint through
# AutoModelForCausalLM after `import linearize` in `make test`.
@pytest.mark.slow
@pytest.mark.parametrize("imports", [
    "import linearize\nfrom transformers import AutoModelForCausalLM",
    "from transformers import AutoModelForCausalLM\nimport linearize",
    # transformers first imported from inside one of our modules: registration waits for that import to end
    "import linearize.attention\nfrom transformers import AutoModelForCausalLM",
    "from linearize.cache import LinearizeCacheLayer\nfrom transformers import AutoModelForCausalLM",
])
def test_auto_classes_find_linearized_checkpoints_in_either_import_order(imports):
    assert python(imports + FROM_PRETRAINED).strip().splitlines()[-1] == "LinearizedLlamaForCausalLM"


@pytest.mark.parametrize("module", ["linearize", "linearize.cli"])
def test_module_entry_points_work(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "convert" in done.stdout
