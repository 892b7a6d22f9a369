"""Stuck- and dead-engine detection behind /health, gRPC health and Serve's `check_health`."""

from __future__ import annotations

from block_manager import KVCacheManager
from cluster.engine.client import EngineHealth
from cluster.engine.metrics import EngineMetrics, Histogram
from cluster.serving.replica_health import StepProgress, replica_problem


def metrics(steps: int, running: int = 0, waiting: int = 0) -> EngineMetrics:
    pressure = KVCacheManager(num_device_blocks=4, num_cpu_blocks=0, block_size=4).pressure()
    return EngineMetrics(
        pressure=pressure,
        num_running=running,
        num_waiting=waiting,
        num_swapped=0,
        preemptions_recompute=0,
        preemptions_swap=0,
        prefix_cache_hit_rate=0.0,
        peak_kv_utilization=0.0,
        peak_used_device_blocks=0,
        num_steps=steps,
        num_generated_tokens=0,
        num_finished_requests=0,
        num_rejected_requests=0,
        ttft_seconds=Histogram(),
        tpot_seconds=Histogram(),
    )


def test_an_engine_with_work_and_no_steps_is_stuck_after_the_limit() -> None:
    progress = StepProgress(stuck_after_s=10)
    assert progress.problem(metrics(5, running=2), now_s=100) is None
    assert progress.problem(metrics(5, running=2), now_s=109) is None
    problem = progress.problem(metrics(5, running=2, waiting=1), now_s=111)
    assert problem is not None and "2 running and 1 waiting" in problem
    assert progress.problem(metrics(6, running=2), now_s=112) is None  # it stepped: healthy again
    assert progress.problem(metrics(6, running=2), now_s=121) is None
    assert progress.problem(metrics(6, running=2), now_s=123) is not None


def test_an_idle_engine_is_never_stuck() -> None:
    progress = StepProgress(stuck_after_s=1)
    for now in range(0, 100, 10):
        assert progress.problem(metrics(3), now_s=now) is None
    assert progress.problem(metrics(3, waiting=1), now_s=100) is None  # work just arrived
    assert progress.problem(metrics(3, waiting=1), now_s=102) is not None


def health(alive: bool, unfinished: int = 0) -> EngineHealth:
    error = None if alive else "the engine step loop failed: RuntimeError('boom')"
    return EngineHealth(
        alive=alive, error=error, last_step_finished_s=1.0, num_unfinished=unfinished
    )


def test_a_dead_step_loop_is_reported_even_when_idle() -> None:
    progress = StepProgress(stuck_after_s=1000)
    assert replica_problem(health(True), progress, metrics(3), now_s=0) is None
    problem = replica_problem(health(False), progress, metrics(3), now_s=1)
    assert problem is not None and "step loop failed" in problem and "boom" in problem
    # A live engine with work that keeps stepping stays healthy.
    assert replica_problem(health(True, 1), progress, metrics(4, running=1), now_s=2) is None
