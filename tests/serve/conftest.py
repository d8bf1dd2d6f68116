"""Fixtures for the server tests: a tiny linearized model on disk, and real `linearize serve` processes on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_helpers import Server, exact_tokenizer


@pytest.fixture(scope="session")
def served_model(tmp_path_factory) -> Path:
    """A tiny Lizard model (new parameters moved off their init) and its exact tokenizer, saved as a folder."""
    from tiny_models import TINY, TINY_OPTIONS, perturb_new_parameters, tiny_teacher

    import linearize

    model = tiny_teacher()
    linearize.convert(model, "lizard", **TINY_OPTIONS["lizard"])
    perturb_new_parameters(model)
    folder = tmp_path_factory.mktemp("serve") / "tiny-lizard"
    model.save_pretrained(folder)
    exact_tokenizer(TINY["vocab_size"]).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def served_teacher(tmp_path_factory) -> Path:
    """The tiny softmax teacher itself (no fixed-size state: the engine serves it request by request)."""
    from tiny_models import TINY, tiny_teacher

    folder = tmp_path_factory.mktemp("serve") / "tiny-teacher"
    tiny_teacher().save_pretrained(folder)
    exact_tokenizer(TINY["vocab_size"]).save_pretrained(folder)
    return folder


@pytest.fixture
def start_server(served_model, tmp_path):
    """Start `linearize serve` on the tiny model with extra flags; every server started is stopped after the test."""
    servers: list[Server] = []

    def start(*flags: str, model: Path = served_model) -> Server:
        servers.append(Server(model, tmp_path / f"server-{len(servers)}.log", *flags))
        return servers[-1]

    yield start
    for server in servers:
        server.close()
