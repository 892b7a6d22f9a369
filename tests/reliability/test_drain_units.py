"""The drain's parts without Ray (cluster/serving/drain.py, drain_board.py): the runner's board
and the gates' reporters on an in-memory key-value store, the gate's admission and expiry, and
the client wrapper that counts and ends streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from cluster.engine.errors import EngineDead, EngineOverloaded
from cluster.serving.drain import DrainGate, DrainingClient, ServerDraining
from cluster.serving.drain_board import (
    PHASE_KEY,
    STALE_AFTER_S,
    GateReporter,
    RunnerBoard,
    encode,
)


class MemoryKeyValue:
    """The `KeyValue` protocol on a dict (what Ray's GCS store does for the board)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def put(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def delete(self, key: str, *, by_prefix: bool = False) -> None:
        for name in [k for k in self.data if (k.startswith(key) if by_prefix else k == key)]:
            del self.data[name]

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self.data if k.startswith(prefix)]


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


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


def test_the_board_sums_live_replicas_and_forgets_silent_ones() -> None:
    clock = Clock()
    kv = MemoryKeyValue()
    board = RunnerBoard(kv, beat_period_s=3600.0, clock=clock)
    board.open()
    a, b = GateReporter(kv, "a", clock), GateReporter(kv, "b", clock)
    a.report_now(2)
    b.report_now(3)
    assert board.in_flight() == (5, 2)
    clock.now_s += STALE_AFTER_S - 0.5
    a.report_now(1)  # a keeps reporting, b went silent
    assert board.in_flight() == (4, 2)
    clock.now_s += 1.0
    assert board.in_flight() == (1, 1)
    assert "in-flight/b" not in kv.data  # the silent replica's key is gone
    board.close()
    assert kv.data == {}


def test_a_gate_follows_the_phase_only_while_the_runners_beat_moves() -> None:
    clock = Clock()
    kv = MemoryKeyValue()
    kv.put(PHASE_KEY, encode("expired", 7))  # left behind by a runner that died
    gate = GateReporter.if_runner(kv, "r", clock)
    assert gate is not None
    assert gate.report_now(0) == "serving"  # a beat never seen moving is not followed
    clock.now_s += 1.0
    assert gate.report_now(0) == "serving"
    board = RunnerBoard(kv, beat_period_s=3600.0, clock=clock)
    board.open()
    assert gate.report_now(0) == "serving"
    board.begin()  # the beat moves with the phase
    assert gate.report_now(1) == "draining"
    board.begin()  # a second begin changes nothing
    assert board.phase == "draining"
    board.expire()
    assert gate.report_now(1) == "expired"
    clock.now_s += STALE_AFTER_S  # the runner stopped beating
    assert gate.report_now(1) == "serving"


def test_a_runners_heartbeat_keeps_its_phase_followed() -> None:
    kv = MemoryKeyValue()
    board = RunnerBoard(kv, beat_period_s=0.01)
    board.open()
    gate = GateReporter(kv, "r")
    board.begin()
    gate.report_now(0)
    first = kv.data[PHASE_KEY]
    deadline = time.monotonic() + 5
    while kv.data[PHASE_KEY] == first and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kv.data[PHASE_KEY] != first  # the beat thread rewrote it
    assert gate.report_now(0) == "draining"
    board.close()
    assert GateReporter.if_runner(kv, "r") is None  # closed: a new gate never drains


def test_a_gate_without_reporter_never_drains() -> None:
    asyncio.run(_a_gate_without_reporter_never_drains())


async def _a_gate_without_reporter_never_drains() -> None:
    gate = DrainGate(None)
    gate.start()
    gate.admit()
    assert gate.problem is None
    await gate.close()


def test_draining_refuses_new_requests_with_a_retry_hint_and_keeps_running_ones() -> None:
    asyncio.run(_draining_refuses_new_requests_with_a_retry_hint_and_keeps_running_ones())


async def _draining_refuses_new_requests_with_a_retry_hint_and_keeps_running_ones() -> None:
    engine = SlowEngine()
    gate = DrainGate(None)
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
    gate = DrainGate(None)
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


def test_the_gate_reports_its_count_and_follows_the_runners_phase() -> None:
    asyncio.run(_the_gate_reports_its_count_and_follows_the_runners_phase())


async def _the_gate_reports_its_count_and_follows_the_runners_phase() -> None:
    kv = MemoryKeyValue()
    board = RunnerBoard(kv, beat_period_s=0.05)
    board.open()
    reporter = GateReporter.if_runner(kv, "replica")
    gate = DrainGate(reporter)
    gate.start()
    gate.in_flight = 2
    await asyncio.sleep(0.3)  # the gate has seen the runner beat
    board.begin()
    for _ in range(50):
        await asyncio.sleep(0.05)
        if gate.phase == "draining":
            break
    assert gate.phase == "draining"
    assert board.in_flight() == (2, 1)
    await gate.close()
    assert board.in_flight() == (0, 0)  # a closed gate removes its count
    board.close()


def test_a_cancelled_consumer_closes_the_engine_stream_at_once() -> None:
    """A client that goes away cancels the task reading the stream (Serve does, for a gRPC
    cancel or an HTTP disconnect): the engine call must be closed then, not run to its end."""

    async def scenario() -> None:
        engine = SlowEngine()
        gate = DrainGate(None)
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
        gate = DrainGate(None)
        stream = DrainingClient(engine, gate).generate("old")
        assert await anext(stream) == "old-first"  # the reader now works between items
        gate.set_phase("expired")
        with pytest.raises(EngineDead):
            await anext(stream)
        assert engine.closed == 1 and gate.in_flight == 0

    asyncio.run(scenario())
