"""Shared test configuration: GPU-marked tests are skipped where CUDA is absent; the tiny model
and a local Ray cluster are shared fixtures."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An HF directory holding the seeded tiny random Llama of `tests/tiny_model.py`."""
    from tests.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local 2-CPU Ray cluster for the module, or the one already running (tests/serving's
    session cluster); only a cluster this fixture started is shut down after."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()
