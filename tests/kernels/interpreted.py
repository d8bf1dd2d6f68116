"""Triton's interpreter (numpy on CPU) for the kernel tests, in a worker subprocess, so that
TRITON_INTERPRET=1 never leaks into the test process.

Each interpreter case is its own test (`-k` selects one). One worker process serves them one at a
time, so torch and triton are imported once per pytest run rather than once per case. A case that raises
fails alone; so does one that kills the worker or runs past its timeout: the worker is killed and
the next case starts a fresh one. The worker puts the backend back to its default before each case.

`make test` runs one case per kernel code path; the others carry the `interpreter` marker
(`cases(...)`) and run in `make test-all`.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

# Replies go to a private copy of stdout; anything a case prints (or Triton warns) goes to stderr.
_WORKER = r"""
import json, os, sys, traceback
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for line in sys.stdin:
    request = json.loads(line)
    print(f"=== {request['name']}", file=sys.stderr, flush=True)
    try:
        from linearize.ops import backend
        backend._chosen = None
        namespace = {"__name__": "interpreted_case"}
        exec(request["code"], namespace)
        reply = {"result": namespace["result"]}
    except BaseException:
        reply = {"error": traceback.format_exc()}
    replies.write(json.dumps(reply) + "\n")
    replies.flush()
"""


class Interpreter:
    """Runs snippets under TRITON_INTERPRET=1 in a worker process; `run` returns the snippet's `result`
    (JSON-serialisable). tests/ and tests/kernels/ are importable there."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._log = None

    def _start(self):
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (open for the worker's life, closed in stop)
        path = os.pathsep.join([str(TESTS / "kernels"), str(TESTS), *sys.path])
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
        self._proc = subprocess.Popen([sys.executable, "-c", _WORKER], env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1)

    def _log_since(self, offset: int, limit: int = 6000) -> str:
        size = os.fstat(self._log.fileno()).st_size
        text = os.pread(self._log.fileno(), size - offset, offset).decode(errors="replace")
        return text[-limit:]

    def stop(self):
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc.stdin.close()
            self._proc.stdout.close()
            self._log.close()
        self._proc = None

    def run(self, code: str, name: str = "snippet", timeout: float = 900):
        if self._proc is None or self._proc.poll() is not None:
            self.stop()
            self._start()
        offset = os.fstat(self._log.fileno()).st_size
        try:
            self._proc.stdin.write(json.dumps({"name": name, "code": code}) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died at start: reported below
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            if ready:
                try:
                    why = f"the worker died (exit status {self._proc.wait(timeout=30)})"
                except subprocess.TimeoutExpired:
                    why = "the worker closed its output"
            else:
                why = f"ran past {timeout} s"
            log = self._log_since(offset)
            self.stop()
            pytest.fail(f"interpreted case {name}: {why}\n{log}", pytrace=False)
        reply = json.loads(line)
        if "error" in reply:
            pytest.fail(f"interpreted case {name} raised:\n{reply['error']}\n{self._log_since(offset)}", pytrace=False)
        return reply["result"]

    def case(self, module: str, name: str, cases: str = "CASES", errors: str = "errors", **options):
        """`module.errors("cpu", *case or **case, **options)` for `module.cases[name]`, interpreted."""
        code = (f"from {module} import {cases} as cases, {errors} as errors\n"
                f"case = cases[{name!r}]\n"
                f"options = {options!r}\n"
                f"result = errors('cpu', **case, **options) if isinstance(case, dict) "
                f"else errors('cpu', *case, **options)\n")
        return self.run(code, f"{module}.{cases}[{name!r}]")


@pytest.fixture(scope="session")
def interpreter():
    """One `Interpreter` for the whole pytest run (tests using it skip where triton is not installed)."""
    pytest.importorskip("triton")
    worker = Interpreter()
    yield worker
    worker.stop()


def cases(names, fast=()) -> list:
    """Parameters for the named interpreter cases: those in `fast` (one per kernel code path) run in
    `make test`; the others are marked `interpreter`, for `make test-all`."""
    unknown = set(fast) - set(names)
    assert not unknown, f"no such cases: {sorted(unknown)}"
    return [pytest.param(name, id=name, marks=() if name in fast else pytest.mark.interpreter) for name in names]
