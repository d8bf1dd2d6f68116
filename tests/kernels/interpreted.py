"""Run a snippet under Triton's interpreter (numpy on CPU) in a subprocess, so that TRITON_INTERPRET=1
never leaks into the test process."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def interpreted(script: str, *args: str, timeout: int = 900):
    """The JSON on the last line `script` prints (tests/ and tests/kernels/ importable there)."""
    path = os.pathsep.join([str(TESTS / "kernels"), str(TESTS), *sys.path])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interpreted_cases(module: str, cases: str = "CASES", errors: str = "errors") -> dict:
    """{name: module.errors("cpu", *case or **case)} for every case of `module.cases`, interpreted."""
    return interpreted(f"""
import json
from {module} import {cases} as cases, {errors} as errors
print(json.dumps({{name: errors("cpu", **case) if isinstance(case, dict) else errors("cpu", *case)
                  for name, case in cases.items()}}))
""")
