"""`num_threads`: torch's intra-op threads set deliberately in the process that runs a CPU rank."""

from __future__ import annotations

import pathlib

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.errors import ConfigError
from workers import WorkerConfig
from workers.config import available_cores


def test_auto_is_the_cores_of_this_process_shared_among_ranks() -> None:
    assert WorkerConfig(num_threads="auto").cpu_threads() == available_cores()
    two_ranks = WorkerConfig(num_threads="auto", tensor_parallel_size=2)
    assert two_ranks.cpu_threads() == max(1, available_cores() // 2)
    assert WorkerConfig(num_threads=3).cpu_threads() == 3
    assert WorkerConfig().cpu_threads() is None


def test_bad_thread_counts_are_refused() -> None:
    for bad in (0, -1, "many", True):
        with pytest.raises(ValueError, match="num_threads"):
            WorkerConfig(num_threads=bad)
    with pytest.raises(ConfigError, match="num_threads"):
        EngineConfig.build({"parallel": {"num_threads": "x"}})
    with pytest.raises(ConfigError, match="num_threads"):
        EngineConfig.build({"parallel": {"num_threads": 0}})


def test_engine_config_passes_the_knob_to_the_workers() -> None:
    config = EngineConfig.build({"parallel": {"num_threads": "2"}})
    assert config.to_worker_config().num_threads == 2
    auto = EngineConfig.build({"parallel": {"num_threads": "auto"}})
    assert auto.to_worker_config().cpu_threads() == available_cores()
    assert EngineConfig().to_worker_config().num_threads is None


def test_a_cpu_rank_sets_torchs_threads_in_its_process(
    tiny_model_dir: pathlib.Path, weights_cache: pathlib.Path
) -> None:
    from workers import WorkerGroup

    before = torch.get_num_threads()  # 1: this directory's fixture
    try:
        group = WorkerGroup(
            WorkerConfig(
                model=str(tiny_model_dir),
                backend="local",
                device="cpu",
                num_threads=before + 1,
                num_device_blocks=8,
                swap_space_bytes=0,
                weights_cache_dir=str(weights_cache),
            )
        )
        assert torch.get_num_threads() == before + 1
        group.shutdown()
    finally:
        torch.set_num_threads(before)
