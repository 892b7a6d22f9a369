"""The KV directory: one named, detached Ray actor per application that owns the cluster-wide
prefix-cache index and pool view (`DirectoryIndex`), plus the two ends that talk to it.

```
engine replica (owns allocation)                 KV directory actor          ingress
  block manager --BlockEvents--> DirectoryPublisher --apply(seq)--> index <--query(chain)--
  (seal / evict / tier move)   every publish_period_s;                       DirectoryClient
                               "resync" answered -> snapshot
```

Invariants:
- engines never wait on the directory to allocate: publishing runs beside the step loop, and
  a batch is O(changes) since the last one;
- a replica's batches carry consecutive sequence numbers; the directory answers a gap (a lost
  or reordered batch, or its own restart with empty state) with "resync", and the replica then
  sends a full snapshot, so the index converges after any loss;
- routing never fails because of the directory: a query that errs or takes longer than
  `query_timeout_s` answers "nothing known" and the client stops asking for `retry_after_s`,
  during which requests are balanced by load alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from block_manager import BlockEvent, PressureSnapshot, TierPressure
from cluster.engine.background import cancel_and_wait
from cluster.serving.directory_index import (
    DirectoryIndex,
    DirectoryStats,
    PoolView,
    PrefixHolding,
    TierOccupancy,
)

log = logging.getLogger(__name__)

DIRECTORY_NAMESPACE = "pagedserve"
LATENCY_WINDOW = 4096


def directory_name(app_name: str) -> str:
    return f"kv-directory:{app_name}"


@dataclass(frozen=True)
class DirectoryReport:
    """What /metrics shows of the directory."""

    stats: DirectoryStats
    events_per_s: float
    query_us_p50: float
    query_us_p99: float
    queries: int
    transfers: dict[tuple[str, str], TransferTally] = field(default_factory=dict)
    """Completed KV pulls, by (holder, receiver) replica pair, as the receivers reported them."""


@dataclass
class TransferTally:
    """Cumulative pulls from one replica into another."""

    pulls: int = 0
    blocks: int = 0
    bytes: int = 0


class KVDirectory:
    """The actor body (create it with `directory_handle`). Single-threaded: calls run in order."""

    def __init__(self, max_entries: int, replica_timeout_s: float) -> None:
        self.index = DirectoryIndex(max_entries, replica_timeout_s)
        self._started_s = time.monotonic()
        self._last_expiry_s = self._started_s
        self._query_us: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._queries = 0
        self._transfers: dict[tuple[str, str], TransferTally] = {}

    def apply(self, replica: str, seq: int, events: list[BlockEvent], pool: PoolView) -> bool:
        """One batch from a replica; False means "send a snapshot"."""
        self._expire()
        return self.index.apply(replica, seq, events, pool)

    def snapshot(
        self, replica: str, seq: int, hashes_by_tier: dict[str, list[bytes]], pool: PoolView
    ) -> None:
        self.index.snapshot(replica, seq, hashes_by_tier, pool)

    def drop(self, replica: str) -> None:
        self.index.drop(replica)

    def query(self, chain: list[bytes]) -> dict[str, PrefixHolding]:
        start = time.perf_counter()
        self._expire()
        holdings = self.index.query(chain)
        self._query_us.append((time.perf_counter() - start) * 1e6)
        self._queries += 1
        return holdings

    def record_transfer(self, holder: str, receiver: str, blocks: int, num_bytes: int) -> None:
        """A receiver pulled `blocks` blocks (`num_bytes` bytes) from `holder`."""
        tally = self._transfers.setdefault((holder, receiver), TransferTally())
        tally.pulls += 1
        tally.blocks += blocks
        tally.bytes += num_bytes

    def report(self) -> DirectoryReport:
        latencies = sorted(self._query_us)
        elapsed = max(time.monotonic() - self._started_s, 1e-9)
        return DirectoryReport(
            stats=self.index.stats(),
            events_per_s=self.index.events_applied / elapsed,
            query_us_p50=_quantile(latencies, 0.5),
            query_us_p99=_quantile(latencies, 0.99),
            queries=self._queries,
            transfers={pair: TransferTally(**vars(t)) for pair, t in self._transfers.items()},
        )

    def _expire(self) -> None:
        now = time.monotonic()
        if now - self._last_expiry_s >= 1.0:
            self._last_expiry_s = now
            for name in self.index.expire(now):
                log.info("KV directory: replica %s went silent; its entries are dropped", name)


def _quantile(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def directory_handle(app_name: str, max_entries: int, replica_timeout_s: float) -> Any:
    """The application's directory actor, created on first use (named and detached: it outlives
    the replica that created it; Ray restarts it when it dies, empty)."""
    actor = ray.remote(KVDirectory).options(
        name=directory_name(app_name),
        namespace=DIRECTORY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        num_cpus=0,
    )
    return actor.remote(max_entries, replica_timeout_s)


def pool_view(pressure: PressureSnapshot) -> PoolView:
    def tier(t: TierPressure) -> TierOccupancy:
        return TierOccupancy(total=t.total, free=t.free, cached=t.evictable_cached, used=t.used)

    return PoolView(device=tier(pressure.device), cpu=tier(pressure.cpu))


@dataclass(frozen=True)
class CacheSource:
    """What a publisher reads from its engine's block manager (called in the engine's loop)."""

    take_events: Callable[[], list[BlockEvent]]
    hashes_by_tier: Callable[[], dict[str, list[bytes]]]
    pressure: Callable[[], PressureSnapshot]


class DirectoryPublisher:
    """Sends one replica's block events to the directory every `period_s` (see the module doc).
    A failed call (the directory is down or restarting) turns the next publication into a
    snapshot. A period with no events and an unchanged pool view sends nothing, except a
    heartbeat once `heartbeat_s` has passed since the last call (which must stay well inside
    the directory's `replica_timeout_s`): an idle replica costs neither process a call every
    period."""

    def __init__(
        self,
        directory: Any,
        replica: str,
        source: CacheSource,
        period_s: float,
        heartbeat_s: float = 1.0,
    ):
        self.directory = directory
        self.replica = replica
        self.source = source
        self.period_s = period_s
        self.heartbeat_s = heartbeat_s
        self.seq = 0
        self.needs_snapshot = True
        self._last_pool: PoolView | None = None
        self._last_sent_s = float("-inf")
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def publish_once(self) -> None:
        events = self.source.take_events()  # taken even when a snapshot replaces them
        pool = pool_view(self.source.pressure())
        now = time.monotonic()
        quiet = not events and not self.needs_snapshot and pool == self._last_pool
        if quiet and now - self._last_sent_s < self.heartbeat_s:
            return
        self._last_pool, self._last_sent_s = pool, now
        self.seq += 1
        try:
            if self.needs_snapshot:
                hashes = self.source.hashes_by_tier()
                await self.directory.snapshot.remote(self.replica, self.seq, hashes, pool)
                self.needs_snapshot = False
            elif not await self.directory.apply.remote(self.replica, self.seq, events, pool):
                self.needs_snapshot = True
        except Exception as error:  # the directory is down: rebuild it once it is back
            log.debug("KV directory unreachable from %s: %r", self.replica, error)
            self.needs_snapshot = True

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.directory.drop.remote(self.replica), timeout=2.0)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self.publish_once()


class DirectoryClient:
    """The ingress's view of the directory: `holdings(chain)` never raises and never waits
    longer than `query_timeout_s` (see the module doc)."""

    def __init__(self, directory: Any, query_timeout_s: float, retry_after_s: float = 1.0):
        self.directory = directory
        self.query_timeout_s = query_timeout_s
        self.retry_after_s = retry_after_s
        self._down_until_s = 0.0
        self.round_trip_us: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.failures = 0

    async def holdings(self, chain: list[bytes]) -> dict[str, int]:
        """Leading blocks of `chain` each replica holds ({} when unknown or unreachable)."""
        if not chain or time.monotonic() < self._down_until_s:
            return {}
        start = time.perf_counter()
        try:
            held: dict[str, PrefixHolding] = await asyncio.wait_for(
                self.directory.query.remote(chain), timeout=self.query_timeout_s
            )
        except Exception as error:
            self.failures += 1
            self._down_until_s = time.monotonic() + self.retry_after_s
            log.warning("KV directory query failed (%r); routing by load for a while", error)
            return {}
        self.round_trip_us.append((time.perf_counter() - start) * 1e6)
        return {replica: holding.blocks for replica, holding in held.items()}

    async def report(self) -> DirectoryReport | None:
        try:
            report: DirectoryReport = await asyncio.wait_for(
                self.directory.report.remote(), timeout=self.query_timeout_s * 4
            )
        except Exception:
            return None
        return report
