"""The drain's parts without Ray (cluster/serving/drain.py): the coordinator's state, the gate's
admission and expiry, and the client wrapper that counts and ends streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cluster.engine.errors import EngineDead, EngineOverloaded
from cluster.serving.drain import (
    STALE_AFTER_S,
    DrainCoordinator,
    DrainGate,
    DrainingClient,
    DrainState,
    ServerDraining,
)


class SlowEngine:
    """An engine client whose streams yield one item, then wait forever; records closes."""

    def __init__(self) -> None:
        self.closed = 0

    async def generate(self, request: str) -> AsyncIterator[str]:
        try:
            yield f"{request}-first"
            await asyncio.Event().wait()
            yield "never"
        finally:
            self.closed += 1


def test_state_expires_at_the_deadline_and_sums_only_fresh_reports() -> None:
    state = DrainState()
    assert state.report("a", 2, now_s=0.0) == "serving"
    state.report("b", 3, now_s=0.0)
    assert state.in_flight(now_s=1.0) == 5
    state.phase, state.deadline_s = "draining", 10.0
    assert state.report("a", 1, now_s=9.0) == "draining"
    assert state.report("a", 1, now_s=10.0) == "expired"
    assert state.in_flight(now_s=STALE_AFTER_S + 0.5) == 1  # b went silent: forgotten


def test_coordinator_begins_once_and_expires_on_demand() -> None:
    coordinator = DrainCoordinator()
    assert coordinator.report("r", 0) == "serving"
    coordinator.begin(60.0)
    deadline = coordinator.state.deadline_s
    coordinator.begin(1.0)  # a second begin does not move the deadline
    assert coordinator.state.deadline_s == deadline
    assert coordinator.report("r", 1) == "draining"
    assert coordinator.in_flight() == (1, 1)
    coordinator.expire()
    assert coordinator.report("r", 1) == "expired"


def test_a_gate_without_coordinator_never_drains() -> None:
    asyncio.run(_a_gate_without_coordinator_never_drains())


async def _a_gate_without_coordinator_never_drains() -> None:
    gate = DrainGate("replica", None)
    gate.start()
    gate.admit()
    assert gate.problem is None
    await gate.close()


def test_draining_refuses_new_requests_with_a_retry_hint_and_keeps_running_ones() -> None:
    asyncio.run(_draining_refuses_new_requests_with_a_retry_hint_and_keeps_running_ones())


async def _draining_refuses_new_requests_with_a_retry_hint_and_keeps_running_ones() -> None:
    engine = SlowEngine()
    gate = DrainGate("replica", None)
    client = DrainingClient(engine, gate)
    running = client.generate("old")
    assert await anext(running) == "old-first"
    assert gate.in_flight == 1
    gate.set_phase("draining")
    assert gate.problem == "the server is shutting down"
    with pytest.raises(ServerDraining) as refused:
        await anext(client.generate("new"))
    assert isinstance(refused.value, EngineOverloaded) and refused.value.retry_after_s > 0
    assert gate.in_flight == 1  # the refused one was never counted
    await running.aclose()
    assert gate.in_flight == 0 and engine.closed == 1


def test_expiry_ends_a_waiting_stream_with_engine_dead_and_closes_the_engine_call() -> None:
    asyncio.run(_expiry_ends_a_waiting_stream_with_engine_dead_and_closes_the_engine_call())


async def _expiry_ends_a_waiting_stream_with_engine_dead_and_closes_the_engine_call() -> None:
    engine = SlowEngine()
    gate = DrainGate("replica", None)
    client = DrainingClient(engine, gate)
    stream = client.generate("old")
    assert await anext(stream) == "old-first"
    gate.set_phase("draining")
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    gate.set_phase("expired")
    with pytest.raises(EngineDead, match="shutting down"):
        await asyncio.wait_for(waiting, 5)
    assert engine.closed == 1
    assert gate.in_flight == 0


def test_the_gate_reports_its_count_and_follows_the_coordinators_phase() -> None:
    asyncio.run(_the_gate_reports_its_count_and_follows_the_coordinators_phase())


async def _the_gate_reports_its_count_and_follows_the_coordinators_phase() -> None:
    coordinator = DrainCoordinator()

    async def report(replica_id: str, in_flight: int) -> str:
        return coordinator.report(replica_id, in_flight)

    gate = DrainGate("replica", report)  # type: ignore[arg-type]
    gate.start()
    gate.in_flight = 2
    coordinator.begin(60.0)
    for _ in range(50):
        await asyncio.sleep(0.05)
        if gate.phase == "draining":
            break
    assert gate.phase == "draining"
    assert coordinator.in_flight() == (2, 1)
    await gate.close()


def test_a_cancelled_consumer_closes_the_engine_stream_at_once() -> None:
    """A client that goes away cancels the task reading the stream (Serve does, for a gRPC
    cancel or an HTTP disconnect): the engine call must be closed then, not run to its end."""

    async def scenario() -> None:
        engine = SlowEngine()
        gate = DrainGate("replica", None)
        client = DrainingClient(engine, gate)

        async def consume() -> None:
            async for _ in client.generate("old"):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        assert engine.closed == 0 and gate.in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.closed == 1
        assert gate.in_flight == 0

    asyncio.run(scenario())


def test_a_reader_between_items_ends_at_its_next_one_once_expired() -> None:
    async def scenario() -> None:
        engine = SlowEngine()
        gate = DrainGate("replica", None)
        stream = DrainingClient(engine, gate).generate("old")
        assert await anext(stream) == "old-first"  # the reader now works between items
        gate.set_phase("expired")
        with pytest.raises(EngineDead):
            await anext(stream)
        assert engine.closed == 1 and gate.in_flight == 0

    asyncio.run(scenario())
