"""Where the serve runner and its ingress replicas meet to drain: a few keys in the cluster's own
key-value store (Ray's GCS), so that the drain has no process of its own. Every Ray worker
process wakes about 100 times a second (its task loop checks for signals every 10 ms), and on a
2-core machine each one beside the engine slows the served decode step by a few percent.

Keys, in `DRAIN_NAMESPACE`:
- `PHASE_KEY`: "<phase> <beat>", written by the runner (`RunnerBoard`); its heartbeat thread
  rewrites it every `BEAT_PERIOD_S` with the beat advanced;
- `IN_FLIGHT_PREFIX` + replica id: "<in-flight count> <beat>", written by each ingress replica's
  `GateReporter` at every poll of its `DrainGate` (cluster/serving/drain.py).

Invariants: no clock is compared across processes. A reader notes, on its own monotonic clock,
when a writer's beat last moved, and a writer whose beat has not moved for `STALE_AFTER_S` is
gone: the runner stops counting that replica (and removes its key), and a gate follows the
runner's phase only while the runner's beat moves, so a runner that died (or keys it left
behind) can never leave replicas refusing work. The runner writes the phase before it deploys
and removes its keys only after Serve has shut down.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, get_args

from cluster.serving.drain import Phase

DRAIN_NAMESPACE = "pagedserve-drain"
PHASE_KEY = "phase"
IN_FLIGHT_PREFIX = "in-flight/"
BEAT_PERIOD_S = 0.5
STALE_AFTER_S = 3.0
"""Silence after which a writer counts as gone: six beats and fifteen gate polls long, so a
busy process is not taken for a dead one."""

CLOSE_WAIT_S = 1.0
"""How long `RunnerBoard.close` waits for its heartbeat thread once the cluster is gone."""

PHASES: tuple[Phase, ...] = get_args(Phase)


class KeyValue(Protocol):
    """A shared string-keyed byte store (Ray's GCS in a cluster; a dict in tests)."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str, *, by_prefix: bool = False) -> None: ...

    def keys(self, prefix: str) -> list[str]: ...


class GcsKeyValue:
    """`KeyValue` on Ray's GCS internal store, in one namespace. Blocking calls (a GCS round
    trip each): the gate runs them off its event loop."""

    def __init__(self, namespace: str = DRAIN_NAMESPACE) -> None:
        from ray.experimental import internal_kv

        self._kv = internal_kv
        self._namespace = namespace

    def get(self, key: str) -> bytes | None:
        return self._kv._internal_kv_get(key, namespace=self._namespace)

    def put(self, key: str, value: bytes) -> None:
        self._kv._internal_kv_put(key, value, True, namespace=self._namespace)

    def delete(self, key: str, *, by_prefix: bool = False) -> None:
        self._kv._internal_kv_del(key, del_by_prefix=by_prefix, namespace=self._namespace)

    def keys(self, prefix: str) -> list[str]:
        found = self._kv._internal_kv_list(prefix, namespace=self._namespace)
        return [key.decode() for key in found]


def encode(word: str, beat: int) -> bytes:
    return f"{word} {beat}".encode()


def decode(raw: bytes) -> tuple[str, int] | None:
    """(word, beat), or None for a value this version did not write."""
    parts = raw.decode(errors="replace").split()
    if len(parts) != 2 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


@dataclass
class BeatWatch:
    """When one writer's beat last moved, on this process's monotonic clock. A writer first
    seen counts as fresh only when `trust_first_sight` (the runner, reading replicas it has not
    polled before); otherwise only once its beat has moved while watched."""

    trust_first_sight: bool
    beat: int | None = None
    moved_at_s: float | None = None

    def fresh(self, beat: int, now_s: float) -> bool:
        if self.beat is None:
            self.moved_at_s = now_s if self.trust_first_sight else None
        elif beat != self.beat:
            self.moved_at_s = now_s
        self.beat = beat
        return self.moved_at_s is not None and now_s - self.moved_at_s < STALE_AFTER_S


@dataclass
class RunnerBoard:
    """The runner's side: publishes the phase with a heartbeat and sums the in-flight counts
    the live replicas report. `open` before the deploy, `close` after Serve has shut down."""

    kv: KeyValue
    beat_period_s: float = BEAT_PERIOD_S
    clock: Callable[[], float] = time.monotonic
    phase: Phase = "serving"
    _beat: int = 0
    _replicas: dict[str, BeatWatch] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def open(self) -> None:
        self.kv.delete(IN_FLIGHT_PREFIX, by_prefix=True)  # left by an earlier runner
        self._publish()
        self._thread = threading.Thread(target=self._beat_loop, name="drain-beat", daemon=True)
        self._thread.start()

    def close(self, remove_keys: bool = True) -> None:
        """Stops the heartbeat and, if `remove_keys`, removes the board's keys (not when the
        cluster, and its store with it, is gone: a beat in flight may then hang, so it is
        waited for only briefly)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(None if remove_keys else CLOSE_WAIT_S)
        if remove_keys:
            self.kv.delete("", by_prefix=True)

    def begin(self) -> None:
        """Stop admitting (a second call changes nothing)."""
        if self.phase == "serving":
            self.phase = "draining"
            self._publish()

    def expire(self) -> None:
        """End every request still running."""
        self.phase = "expired"
        self._publish()

    def in_flight(self) -> tuple[int, int]:
        """Requests in flight across the live ingress replicas, and how many replicas that is."""
        now_s = self.clock()
        total = live = 0
        listed = self.kv.keys(IN_FLIGHT_PREFIX)
        self._replicas = {k: w for k, w in self._replicas.items() if k in listed}  # closed ones
        for key in listed:
            raw = self.kv.get(key)
            reported = None if raw is None else decode(raw)
            if reported is None or not reported[0].isdigit():
                continue
            watch = self._replicas.setdefault(key, BeatWatch(trust_first_sight=True))
            if watch.fresh(reported[1], now_s):
                total += int(reported[0])
                live += 1
            else:  # the replica went silent: forget it
                del self._replicas[key]
                self.kv.delete(key)
        return total, live

    def _publish(self) -> None:
        with self._lock:
            self._beat += 1
            self.kv.put(PHASE_KEY, encode(self.phase, self._beat))

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.beat_period_s):
            try:
                self._publish()
            except Exception:
                continue


class GateReporter:
    """An ingress replica's side (the `DrainGate`'s reporter): writes its in-flight count with
    a beat of its own and reads the runner's phase, off the event loop."""

    def __init__(
        self, kv: KeyValue, replica_id: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.kv = kv
        self.clock = clock
        self.key = IN_FLIGHT_PREFIX + replica_id
        self._beat = 0
        self._runner = BeatWatch(trust_first_sight=False)

    @classmethod
    def if_runner(
        cls, kv: KeyValue, replica_id: str, clock: Callable[[], float] = time.monotonic
    ) -> GateReporter | None:
        """A reporter when a runner has published a phase, else None (the app was started by
        `serve run` or a test: it never drains)."""
        return cls(kv, replica_id, clock) if kv.get(PHASE_KEY) is not None else None

    async def report(self, in_flight: int) -> Phase:
        return await asyncio.to_thread(self.report_now, in_flight)

    async def close(self) -> None:
        await asyncio.to_thread(self.kv.delete, self.key)

    def report_now(self, in_flight: int) -> Phase:
        """Writes the count and returns the phase to follow: the runner's while its beat moves,
        "serving" otherwise."""
        self._beat += 1
        self.kv.put(self.key, encode(str(in_flight), self._beat))
        raw = self.kv.get(PHASE_KEY)
        published = None if raw is None else decode(raw)
        if published is None or published[0] not in PHASES:
            return "serving"
        fresh = self._runner.fresh(published[1], self.clock())
        return published[0] if fresh else "serving"  # type: ignore[return-value]
