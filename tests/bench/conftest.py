"""Fixtures for the bench tests: one CPU thread, and the tests folder importable when this folder runs alone."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tiny_models


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run far faster on one thread than with OpenMP spinning on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory):
    from tiny_models import save_tiny_teacher

    return save_tiny_teacher(tmp_path_factory.mktemp("bench") / "teacher")
