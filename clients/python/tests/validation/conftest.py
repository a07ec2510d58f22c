"""The blind validation set: the `validation` marker (run the set alone with
``-m validation``), one CPU thread per case, and the session server of
``tests/conftest.py``."""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "validation: the blind validation set (public threads, expectations fixed before "
        "gradflow first ran on them)",
    )


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and the cases share two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
