"""The import contracts in pyproject.toml ([tool.importlinter]) hold: each layer of linearize imports only the layers
below it, linearize never imports experiments, and no package has an import circle (function-level imports count)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint_imports), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
