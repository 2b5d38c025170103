"""Fixtures of every layer. The end-to-end tests' servers are tests/e2e/conftest.py's."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    """The markers mean what pyproject.toml says: a test that starts a tritonserver (the e2e
    tests' `tritonserver` fixture, or a cluster of them) is marked e2e, so `-m "not e2e"`
    leaves out every server."""
    for item in items:
        starts_servers = {"tritonserver", "cluster"} & set(getattr(item, "fixturenames", ()))
        if starts_servers and item.get_closest_marker("e2e") is None:
            raise pytest.UsageError(f"{item.nodeid} starts a tritonserver (fixture {sorted(starts_servers)[0]}) "
                                    "but is not marked e2e")


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of small tensors (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`):
    intra-op threads only add overhead there, ~10x of it on a busy 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_checkpoint_options() -> dict:
    """The arguments of `make_tiny_checkpoint` (tests/checkpoints.py) behind a module's
    `tiny_checkpoint`: none, a tiny Llama. A module that needs another shape overrides this
    fixture, e.g. `return {"max_position_embeddings": 4096}`."""
    return {}


@pytest.fixture(scope="session")
def _tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    return {}


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_checkpoint_options, _tiny_checkpoints, tmp_path_factory) -> str:
    """The folder of a tiny random-weight checkpoint (`tiny_checkpoint_options`), made once a
    session for each set of options and shared by every module that asks for it: read it, never
    change it (a test that changes a checkpoint makes its own)."""
    from tests.checkpoints import make_tiny_checkpoint

    key = repr(sorted(tiny_checkpoint_options.items()))
    if key not in _tiny_checkpoints:
        folder = tmp_path_factory.mktemp("tiny-checkpoint") / "ckpt"
        _tiny_checkpoints[key] = make_tiny_checkpoint(str(folder), **tiny_checkpoint_options)
    return _tiny_checkpoints[key]
