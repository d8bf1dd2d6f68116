"""The experiments' tests share the product suite's fixtures: its tiny models and offline tokenizer."""

import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_suite = _load("suite_conftest", TESTS / "conftest.py")
_eval = _load("eval_conftest", TESTS / "eval" / "conftest.py")
one_thread, default_backend = _suite.one_thread, _suite.default_backend
tokenizer, model, new_model = _eval.tokenizer, _eval.model, _eval.new_model
