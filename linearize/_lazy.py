"""Names a package loads on first use (PEP 562), so that importing it stays cheap (no torch)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """(`__getattr__`, `__dir__`) for `package`, whose public name N lives in submodule `exports[N]`."""

    def __getattr__(name: str):
        if name not in exports:
            # A submodule not imported yet (`linearize.decode.greedy_decode` after `import linearize`).
            if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
                return importlib.import_module(f"{package}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        vars(sys.modules[package])[name] = value  # later lookups find it without this hook
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
