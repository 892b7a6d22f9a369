"""`num_threads`: torch's intra-op threads set deliberately in the process that runs a CPU rank."""

from __future__ import annotations

import asyncio
import pathlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.errors import ConfigError
from workers import WorkerConfig
from workers.config import available_cores
from workers.plan import SamplingSettings, SequenceWork, StepPlan


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
                dtype="float32",
                model=str(tiny_model_dir),
                backend="local",
                device="cpu",
                num_threads=before + 1,
                num_device_blocks=8,
                swap_space_bytes=0,
                weights_cache_dir=str(weights_cache),
            )
        )
        # OpenMP keeps the count per thread: it is set on the thread that runs the forward
        # pass, not on the caller's
        assert group._rank_thread is not None
        assert group._rank_thread.call(torch.get_num_threads) == before + 1
        group.shutdown()
    finally:
        torch.set_num_threads(before)


def test_every_torch_call_of_a_local_rank_runs_on_one_thread(
    tiny_model_dir: pathlib.Path, weights_cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Load, synchronous steps from two different threads and awaited steps all run on the
    rank's own thread, with the caller's torch thread count (adapter reads on another thread,
    with one torch thread): one OpenMP team, not one per calling thread, whose teams would
    slow every decode step."""
    from workers import WorkerGroup
    from workers.rank import WorkerRank

    seen: list[tuple[str, int, int]] = []

    def recording(name: str) -> Any:
        original = getattr(WorkerRank, name)

        def wrapper(self: WorkerRank, *args: Any, **kwargs: Any) -> Any:
            seen.append((name, threading.get_ident(), torch.get_num_threads()))
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("load", "allocate", "execute", "execute_with_logits", "add_lora", "shutdown"):
        monkeypatch.setattr(WorkerRank, name, recording(name))
    config = WorkerConfig(
        dtype="float32",
        model=str(tiny_model_dir),
        backend="local",
        device="cpu",
        block_size=4,
        num_device_blocks=8,
        swap_space_bytes=0,
        weights_cache_dir=str(weights_cache),
    )
    callers = {threading.get_ident()}
    with ThreadPoolExecutor(1) as builder:
        group = builder.submit(WorkerGroup, config).result()
        callers.add(builder.submit(threading.get_ident).result())
    prompt = SequenceWork(
        seq_id=0,
        token_ids=[5, 6, 7],
        start_pos=0,
        table_blocks=[0],
        num_samples=1,
        sampling=SamplingSettings(temperature=0.0),
    )
    group.execute(StepPlan(1, [prompt]))
    with ThreadPoolExecutor(1) as other:
        other.submit(group.execute, StepPlan(2, [SequenceWork(0, [8], 3, 1, [], 1)])).result()
        callers.add(other.submit(threading.get_ident).result())
    asyncio.run(group.execute_async(StepPlan(3, [SequenceWork(0, [9], 4, 1, [1], 1)])))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        group.add_lora("/no/adapter")
    group.shutdown()
    # adapter files are read beside the steps, on one torch thread (no second OpenMP team)
    (adapter_thread, adapter_torch_threads) = next(
        (ident, count) for name, ident, count in seen if name == "add_lora"
    )
    seen = [entry for entry in seen if entry[0] != "add_lora"]
    assert adapter_torch_threads == 1
    names = [name for name, _, _ in seen]
    assert names[:2] == ["load", "allocate"] and names[-1] == "shutdown"
    assert names.count("execute") + names.count("execute_with_logits") >= 3
    threads = {ident for _, ident, _ in seen}
    assert len(threads) == 1 and threads.isdisjoint(callers | {adapter_thread})
    assert {count for _, _, count in seen} == {torch.get_num_threads()}
