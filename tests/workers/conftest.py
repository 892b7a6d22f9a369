"""Fixtures of the workers tests: the tiny model as a local group and as the HF reference."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch
import transformers

from workers import WorkerConfig, WorkerGroup

TINY_BLOCK_SIZE = 4
TINY_DEVICE_BLOCKS = 96


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run these tests' torch ops on one thread: on a small shared machine, intra-op threads
    that spin while other processes hold the cores make every step several times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def weights_cache(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("weights_cache")


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_dir: pathlib.Path) -> transformers.PreTrainedModel:
    """The HF transformers reference with the tiny model's weights (float32, eval)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_group(tiny_model_dir: pathlib.Path, weights_cache: pathlib.Path) -> Iterator[WorkerGroup]:
    """The tiny model on one in-process rank: 96 blocks of 4 tokens, 16 CPU swap blocks."""
    group = WorkerGroup(
        WorkerConfig(
            model=str(tiny_model_dir),
            backend="local",
            block_size=TINY_BLOCK_SIZE,
            num_device_blocks=TINY_DEVICE_BLOCKS,
            num_cpu_blocks=16,
            weights_cache_dir=str(weights_cache),
        )
    )
    yield group
    group.shutdown()
