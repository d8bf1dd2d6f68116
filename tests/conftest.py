"""Suite-wide fixtures. This folder is on sys.path (as rootdir conftest), so `tiny_models` imports anywhere."""

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run far faster on one thread than with OpenMP spinning on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def default_backend():
    """Each test starts on the default backend, whatever the one before it chose."""
    from linearize.ops import backend

    backend._chosen = None
    yield
    backend._chosen = None
