"""Which implementation every op runs: the one switch between the Triton kernels and the PyTorch ops.

    auto    the Triton kernels wherever they apply (triton importable, CUDA tensors, or CPU tensors
            under TRITON_INTERPRET=1, and shapes the kernels take), the PyTorch ops elsewhere
    triton  as auto, but refuse to run where the kernels cannot run at all (no triton, no device)
    torch   the PyTorch ops everywhere (A/B timings, debugging, a GPU where a kernel misbehaves)

Each op's form (`chunk_gla_window`, `continue_still`, ...) lists its implementations in order of
preference (`Implementation`: a name, whether it runs kernels, `supports(call) -> reason or None`,
`run(call)`), its PyTorch one last, in a `Form`: calling it runs the first the backend allows that
supports the call (`recording` lists which ran).

Set it with `set_backend`, for a block with `use_backend`, from the command line with `--backend`, or
with the environment variable LINEARIZE_BACKEND; the default is auto. Both forms give the same
results within rounding: every kernel is tested against its op's PyTorch reference.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

BACKENDS = ("auto", "triton", "torch")
_chosen: str | None = None


class BackendError(ValueError):
    """A backend that does not exist, or the Triton kernels asked for where they cannot run."""


def _checked(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise BackendError(f"{source} must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def get_backend() -> str:
    """The backend in force: the one set last, else $LINEARIZE_BACKEND, else auto."""
    if _chosen is not None:
        return _chosen
    return _checked(os.environ.get("LINEARIZE_BACKEND", "auto"), "LINEARIZE_BACKEND")


def set_backend(name: str) -> None:
    global _chosen
    _chosen = _checked(name, "backend")
    if name == "triton" and not kernels_available():
        raise BackendError("backend 'triton' needs triton and a CUDA device (or TRITON_INTERPRET=1)")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """`set_backend(name)` for the duration of a block."""
    global _chosen
    before = _chosen
    try:
        set_backend(name)
        yield
    finally:
        _chosen = before


_triton_importable: bool | None = None


def triton_importable() -> bool:
    global _triton_importable
    if _triton_importable is None:  # a plain flag, not functools.cache: compiled code reads it too
        try:
            import triton  # noqa: F401

            _triton_importable = True
        except ImportError:
            _triton_importable = False
    return _triton_importable


def interpreting() -> bool:
    """TRITON_INTERPRET=1: the Triton kernels run on CPU tensors through numpy (slow; for tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernels_available() -> bool:
    """Whether the Triton kernels can run here at all: triton importable and a CUDA device or the interpreter."""
    import torch

    return triton_importable() and (torch.cuda.is_available() or interpreting())


def use_kernels() -> bool:
    """Whether the ops should try their Triton kernels (each op still checks that its kernel takes the inputs)."""
    backend = get_backend()
    if backend == "torch":
        return False
    if backend == "triton" and not kernels_available():
        raise BackendError("backend 'triton' needs triton and a CUDA device (or TRITON_INTERPRET=1)")
    return kernels_available()


@dataclass(frozen=True)
class Implementation:
    """One way to compute a form of an op: `supports(call)` says why it cannot take a call (None: it
    can), `run(call)` computes it. `kernels`: it runs Triton kernels, so the backend must allow them."""

    name: str
    supports: Callable[[Any], str | None]
    run: Callable[[Any], Any]
    kernels: bool = True


def always(call) -> None:
    """`supports` of an implementation that takes every call (the PyTorch forms)."""
    return


@dataclass(frozen=True)
class Form:
    """One form of an op (`chunk_gla_window`, ...) and its implementations in order of preference, the
    last one (PyTorch) taking every call. Calling it runs `call` through the first the backend allows
    that takes it."""

    name: str
    implementations: tuple[Implementation, ...]

    def reasons(self, call) -> dict[str, str | None]:
        """Each implementation's reason not to take `call` (None: it would), in order of preference."""
        kernels = self._kernels()
        refused = "the backend is torch" if get_backend() == "torch" else "triton or a CUDA device missing"
        return {impl.name: refused if impl.kernels and not kernels else impl.supports(call)
                for impl in self.implementations}

    def pick(self, call) -> Implementation:
        kernels = self._kernels()
        for impl in self.implementations:
            if (kernels or not impl.kernels) and impl.supports(call) is None:
                return impl
        raise ValueError(f"no implementation of {self.name} takes this call: {self.reasons(call)}")

    def __call__(self, call):
        impl = self.pick(call)
        for record in _records:
            record.append((self.name, impl.name))
        return impl.run(call)

    def _kernels(self) -> bool:
        # A form without kernels never asks: `triton` refuses only where a kernel would be wanted.
        return any(impl.kernels for impl in self.implementations) and use_kernels()


_records: list[list[tuple[str, str]]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, str]]]:
    """The (form, implementation) of every op call in the block, in order (for tests and checks)."""
    record: list[tuple[str, str]] = []
    _records.append(record)
    try:
        yield record
    finally:
        _records.remove(record)
