"""Fixtures for the bench tests."""

import pytest


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory):
    from tiny_models import save_tiny_teacher

    return save_tiny_teacher(tmp_path_factory.mktemp("bench") / "teacher")
