"""`linearize serve`'s flags: bad ones exit 2 with one line before any model loads, and --help stays light."""

import json
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from serve_helpers import free_port

from linearize.cli import main
from linearize.serve.command import end_tokens, memory_size

ROOT = Path(__file__).resolve().parents[2]


def refused(capsys, *argv: str) -> str:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(("flag", "value"), [("--port", "0"), ("--port", "65536"), ("--port", "http"),
                                             ("--max-batch", "0"), ("--max-queue", "-1"), ("--max-prompt-tokens", "0"),
                                             ("--max-completion-tokens", "-3"), ("--prefill-chunk", "1.5"),
                                             ("--prefill-budget", "-1"), ("--prefill-budget", "nan"),
                                             ("--prefill-budget", "fast"),
                                             ("--kv-memory", "0"), ("--kv-memory", "-2GiB"), ("--kv-memory", "lots"),
                                             ("--kv-memory", "4XB"), ("--kv-memory", "inf"), ("--prefix-block", "0"),
                                             ("--prefix-cache-memory", "0"), ("--prefix-cache-memory", "big"),
                                             ("--prefix-cache-host-memory", "0"),
                                             ("--prefix-cache-host-memory", "-1GiB")])
def test_bad_numbers_are_refused_by_flag(capsys, flag, value):
    assert flag in refused(capsys, "--model", "nowhere", flag, value)


def test_a_host_tier_without_the_prefix_cache_is_refused(capsys, tmp_path):
    err = refused(capsys, "--model", str(tmp_path / "nowhere"), "--no-prefix-cache", "--prefix-cache-host-memory", "4GiB")
    assert "--prefix-cache-host-memory needs the prefix cache" in err


def test_memory_sizes_read_binary_units():
    assert [memory_size(t) for t in ("40GiB", "512 MiB", "1.5KiB", "1000", "2TiB", "8B")] == [
        40 * 2**30, 512 * 2**20, 1536, 1000, 2 * 2**40, 8]


def test_a_missing_model_is_refused(capsys, tmp_path):
    err = refused(capsys, "--model", str(tmp_path / "nowhere"), "--port", str(free_port()))
    assert err.startswith("linearize: error: no such model file or folder")


def test_a_taken_port_is_refused_before_the_model_loads(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = refused(capsys, "--model", str(tmp_path / "nowhere"), "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in err


@pytest.mark.parametrize(("flag", "value"), [("--host", " "), ("--served-model-name", ""), ("--device", "gpu9")])
def test_empty_names_and_bad_devices_are_refused(capsys, flag, value):
    assert flag in refused(capsys, "--model", "nowhere", flag, value)


def test_help_imports_nothing_heavy():
    heavy = ("torch", "transformers", "fastapi", "uvicorn", "starlette", "pydantic")
    code = ("import json, sys\nfrom linearize.cli import main\ntry:\n    main(['serve', '--help'])\nexcept SystemExit:\n"
            f"    pass\nprint(json.dumps([m for m in {heavy!r} if m in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert "--max-batch" in done.stdout
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_end_tokens_join_the_generation_config_and_the_tokenizer():
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[1, 106]))
    assert end_tokens(model, SimpleNamespace(eos_token_id=1)) == (1, 106)
    assert end_tokens(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None)),
                      SimpleNamespace(eos_token_id=2)) == (2,)
