"""The kernel tests' interpreter worker, one for the whole pytest run (see interpreted.py), and the GPU
tests' switch for STILL's chunked kernel, which a GPU runs only once these tests have checked it there."""

import pytest
from interpreted import interpreter  # noqa: F401

from linearize.ops.still import CHUNK_KERNEL_ON_GPU


@pytest.fixture(autouse=True)
def _still_chunk_kernel_on_gpu(request, monkeypatch):
    if request.node.get_closest_marker("gpu"):
        monkeypatch.setenv(CHUNK_KERNEL_ON_GPU, "1")
