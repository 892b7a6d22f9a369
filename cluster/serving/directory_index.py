"""The cluster-wide prefix-cache index and pool view that the KV directory actor holds.

Each engine replica owns allocation in its own TP group's pools; this index only follows them,
from the replicas' `BlockEvent` batches (a block's exact chain hash stored in or removed from a
tier), plus a full snapshot whenever a replica's batches stop lining up. It answers, for a
prompt's hash chain, how many leading blocks each replica holds and how many of those on the
device.

Invariants:
- a replica's batches apply only in sequence (`seq` = the last applied + 1); any gap, reorder or
  unknown replica is refused and answered "resync", after which only a snapshot is accepted, so
  the index never holds a guess built on a lost batch;
- at most `max_entries` hashes are indexed; the least recently stored or hit go first (the
  replicas keep those blocks: forgetting one costs a recompute on a miss, never a wrong answer);
- a replica that stopped reporting for `replica_timeout_s` is dropped with all its entries.

Representation: each hash maps to one int with bit `r` set when replica slot `r` holds it on
the device and bit `r + SLOT_BITS` when it holds it on the CPU tier, so an entry costs one dict
slot and (almost always) a cached small int.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from block_manager import BlockEvent

SLOT_BITS = 64
"""Replica slots per directory (one per engine replica of the application)."""
_DEVICE_MASK = (1 << SLOT_BITS) - 1


@dataclass(frozen=True)
class TierOccupancy:
    """One tier of a replica's pool, in blocks."""

    total: int = 0
    free: int = 0
    cached: int = 0
    used: int = 0


@dataclass(frozen=True)
class PoolView:
    """A replica's pools as it last reported them."""

    device: TierOccupancy = field(default_factory=TierOccupancy)
    cpu: TierOccupancy = field(default_factory=TierOccupancy)


@dataclass(frozen=True)
class PrefixHolding:
    """How many leading blocks of a chain a replica holds: on either tier, and on the device."""

    blocks: int
    device_blocks: int


@dataclass
class ReplicaRecord:
    slot: int
    seq: int
    pool: PoolView
    last_heard_s: float
    entries: dict[str, int] = field(default_factory=lambda: {"device": 0, "cpu": 0})


@dataclass(frozen=True)
class DirectoryStats:
    entries: int
    max_entries: int
    entries_by_replica: dict[str, dict[str, int]]
    pools: dict[str, PoolView]
    events_applied: int
    snapshots: int
    resyncs_requested: int
    evicted_entries: int


class DirectoryIndex:
    """The index (see the module doc). Not thread-safe: the actor calls it from one thread."""

    def __init__(self, max_entries: int = 1_000_000, replica_timeout_s: float = 10.0) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.replica_timeout_s = replica_timeout_s
        self._entries: dict[bytes, int] = {}  # insertion order = LRU order (oldest first)
        self._replicas: dict[str, ReplicaRecord] = {}
        self._slots: dict[int, str] = {}
        self.events_applied = 0
        self.snapshots = 0
        self.resyncs_requested = 0
        self.evicted_entries = 0

    # --- updates from replicas --------------------------------------------------------------

    def apply(
        self,
        replica: str,
        seq: int,
        events: Sequence[BlockEvent],
        pool: PoolView,
        now_s: float | None = None,
    ) -> bool:
        """Applies one batch; False (nothing applied) when `seq` is not the next expected one:
        the replica must then send a `snapshot`."""
        record = self._replicas.get(replica)
        if record is None or seq != record.seq + 1:
            self.resyncs_requested += 1
            return False
        record.seq = seq
        record.pool = pool
        record.last_heard_s = time.monotonic() if now_s is None else now_s
        entries, counts = self._entries, record.entries
        device_bit = 1 << record.slot
        cpu_bit = device_bit << SLOT_BITS
        for stored, digest, tier in events:
            bit = device_bit if tier == "device" else cpu_bit
            mask = entries.pop(digest, 0)  # re-inserted below: now the most recent
            if stored:
                if not mask & bit:
                    counts[tier] += 1
                mask |= bit
            elif mask & bit:
                counts[tier] -= 1
                mask &= ~bit
            if mask:
                entries[digest] = mask
        self.events_applied += len(events)
        self._bound()
        return True

    def snapshot(
        self,
        replica: str,
        seq: int,
        hashes_by_tier: dict[str, list[bytes]],
        pool: PoolView,
        now_s: float | None = None,
    ) -> None:
        """Replaces everything known of `replica` with its full cached set; its next batch must
        carry `seq + 1`."""
        self.drop(replica)
        slot = self._free_slot()
        record = ReplicaRecord(slot, seq, pool, time.monotonic() if now_s is None else now_s)
        self._replicas[replica] = record
        self._slots[slot] = replica
        events = [
            BlockEvent(True, digest, tier)  # type: ignore[arg-type]
            for tier, hashes in hashes_by_tier.items()
            for digest in hashes
        ]
        record.seq = seq - 1
        self.apply(replica, seq, events, pool, now_s)
        self.events_applied -= len(events)
        self.snapshots += 1

    def drop(self, replica: str) -> None:
        """Forgets `replica` and every entry it held (O(entries): replicas leave rarely)."""
        record = self._replicas.pop(replica, None)
        if record is None:
            return
        del self._slots[record.slot]
        keep = ~((1 << record.slot) | (1 << (record.slot + SLOT_BITS)))
        entries = self._entries
        for digest in list(entries):
            mask = entries[digest] & keep
            if mask:
                entries[digest] = mask
            else:
                del entries[digest]

    def expire(self, now_s: float | None = None) -> list[str]:
        """Drops replicas silent for longer than `replica_timeout_s`; returns their names."""
        now_s = time.monotonic() if now_s is None else now_s
        silent = [
            name
            for name, record in self._replicas.items()
            if now_s - record.last_heard_s > self.replica_timeout_s
        ]
        for name in silent:
            self.drop(name)
        return silent

    # --- queries -----------------------------------------------------------------------------

    def query(self, chain: Sequence[bytes]) -> dict[str, PrefixHolding]:
        """For each replica holding the chain's first block: its leading blocks held (any tier)
        and held on the device. A hit refreshes the entries' recency."""
        entries = self._entries
        any_alive = dev_alive = -1
        found: list[int] = []
        for digest in chain:
            mask = entries.get(digest, 0)
            any_alive &= (mask | (mask >> SLOT_BITS)) & _DEVICE_MASK
            dev_alive &= mask & _DEVICE_MASK
            if not any_alive:
                break
            found.append(any_alive | (dev_alive << SLOT_BITS))
        for digest in chain[: len(found)]:  # refresh recency of what was hit
            entries[digest] = entries.pop(digest)
        holdings: dict[str, PrefixHolding] = {}
        for slot, name in self._slots.items():
            bit = 1 << slot
            blocks = sum(1 for packed in found if packed & bit)
            if blocks:
                dev = sum(1 for packed in found if (packed >> SLOT_BITS) & bit)
                holdings[name] = PrefixHolding(blocks, dev)
        return holdings

    def stats(self) -> DirectoryStats:
        return DirectoryStats(
            entries=len(self._entries),
            max_entries=self.max_entries,
            entries_by_replica={n: dict(r.entries) for n, r in self._replicas.items()},
            pools={n: r.pool for n, r in self._replicas.items()},
            events_applied=self.events_applied,
            snapshots=self.snapshots,
            resyncs_requested=self.resyncs_requested,
            evicted_entries=self.evicted_entries,
        )

    # --- helpers -----------------------------------------------------------------------------

    def _free_slot(self) -> int:
        for slot in range(SLOT_BITS):
            if slot not in self._slots:
                return slot
        raise RuntimeError(f"the directory tracks at most {SLOT_BITS} engine replicas")

    def _bound(self) -> None:
        """Evicts the least recently stored or hit entries beyond `max_entries`."""
        entries = self._entries
        excess = len(entries) - self.max_entries
        if excess <= 0:
            return
        for digest in _first(entries, excess):
            mask = entries.pop(digest)
            for record in self._replicas.values():
                bit = 1 << record.slot
                if mask & bit:
                    record.entries["device"] -= 1
                if mask & (bit << SLOT_BITS):
                    record.entries["cpu"] -= 1
        self.evicted_entries += excess


def _first(entries: dict[bytes, int], count: int) -> list[bytes]:
    """The `count` oldest keys without copying the whole dict."""
    oldest: list[bytes] = []
    for digest in entries:
        oldest.append(digest)
        if len(oldest) == count:
            break
    return oldest
