"""Fixtures of every layer. The end-to-end tests' servers are tests/e2e/conftest.py's."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of small tensors (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`):
    intra-op threads only add overhead there, ~10x of it on a busy 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
