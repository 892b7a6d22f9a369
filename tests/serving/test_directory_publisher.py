"""`DirectoryPublisher` against a fake directory: it sends every event batch in sequence, resyncs
with a snapshot after a failure, and sends nothing in a quiet period but a heartbeat."""

from __future__ import annotations

import asyncio
import types
from dataclasses import dataclass, field
from typing import Any

from block_manager import TierPressure
from cluster.serving.kv_directory import CacheSource, DirectoryPublisher


@dataclass
class FakeMethod:
    calls: list[tuple[Any, ...]]
    answer: Any = True
    fail: bool = False

    async def _call(self, *args: Any) -> Any:
        if self.fail:
            raise RuntimeError("directory down")
        self.calls.append(args)
        return self.answer

    def remote(self, *args: Any) -> Any:
        return self._call(*args)


@dataclass
class FakeDirectory:
    snapshots: list[tuple[Any, ...]] = field(default_factory=list)
    applied: list[tuple[Any, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.snapshot = FakeMethod(self.snapshots)
        self.apply = FakeMethod(self.applied)


@dataclass
class FakeEngine:
    events: list[Any] = field(default_factory=list)
    free: int = 10

    def take_events(self) -> list[Any]:
        taken, self.events = self.events, []
        return taken

    def pressure(self) -> Any:
        """The two tiers, all the publisher reads of a `PressureSnapshot`."""
        tier = TierPressure(total=10, free=self.free, evictable_cached=0, used=10 - self.free)
        return types.SimpleNamespace(device=tier, cpu=TierPressure(0, 0, 0, 0))


def _publisher(directory: FakeDirectory, engine: FakeEngine, heartbeat_s: float) -> Any:
    source = CacheSource(
        take_events=engine.take_events,
        hashes_by_tier=lambda: {"device": [b"h"]},
        pressure=engine.pressure,
    )
    return DirectoryPublisher(directory, "r1", source, period_s=0.01, heartbeat_s=heartbeat_s)


def test_quiet_periods_send_nothing_until_the_heartbeat() -> None:
    async def scenario() -> None:
        directory, engine = FakeDirectory(), FakeEngine()
        publisher = _publisher(directory, engine, heartbeat_s=3600.0)
        await publisher.publish_once()  # the first call is always a snapshot
        assert len(directory.snapshots) == 1 and not directory.applied
        for _ in range(5):
            await publisher.publish_once()
        assert not directory.applied  # nothing changed: no calls
        engine.events.append("seal")
        await publisher.publish_once()
        assert [call[1:3] for call in directory.applied] == [(2, ["seal"])]
        engine.free = 7  # the pool view changed, no block events
        await publisher.publish_once()
        assert [call[1] for call in directory.applied] == [2, 3]  # consecutive sequence numbers
        publisher.heartbeat_s = 0.0
        await publisher.publish_once()  # quiet, but the heartbeat is due
        assert [call[1:3] for call in directory.applied][-1] == (4, [])

    asyncio.run(scenario())


def test_a_failed_call_turns_the_next_publication_into_a_snapshot() -> None:
    async def scenario() -> None:
        directory, engine = FakeDirectory(), FakeEngine()
        publisher = _publisher(directory, engine, heartbeat_s=3600.0)
        await publisher.publish_once()
        directory.apply.fail = True
        engine.events.append("evict")
        await publisher.publish_once()
        directory.apply.fail = False
        await publisher.publish_once()  # quiet, yet the directory must be rebuilt
        assert len(directory.snapshots) == 2
        directory.apply.answer = False  # "resync": the directory lost its state
        engine.events.append("seal")
        await publisher.publish_once()
        await publisher.publish_once()
        assert len(directory.snapshots) == 3

    asyncio.run(scenario())
