"""Which implementation every op runs: the one switch between the Triton kernels and the PyTorch ops.

    auto    the Triton kernels wherever they apply (triton importable, CUDA tensors, or CPU tensors
            under TRITON_INTERPRET=1, and shapes the kernels take), the PyTorch ops elsewhere
    triton  as auto, but refuse to run where the kernels cannot run at all (no triton, no device)
    torch   the PyTorch ops everywhere (A/B timings, debugging, a GPU where a kernel misbehaves)

Set it with `set_backend`, for a block with `use_backend`, from the command line with `--backend`, or
with the environment variable LINEARIZE_BACKEND; the default is auto. Both forms give the same
results within rounding: every kernel is tested against its op's PyTorch reference.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

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
