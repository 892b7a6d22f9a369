"""Where a router has just sent each prompt's blocks: a bounded hash -> replicas index.

The KV directory is the cluster's one record of which replica holds which blocks; it learns of
a block once the replica computed it and sent its next event batch. Between the routing of a
request and that moment, a repeat of the same prefix should still follow it, so each router
records where it sent each chain (`record`) and the choice takes the longer of the directory's
and this record's prefix per replica.

Invariants:
- `PrefixIndex` never holds more than its capacity (least recently recorded entries go first);
- `PrefixIndex.longest_prefixes` gives each replica the number of leading blocks of the chain it
  holds, all of them, without a gap (a hash chain makes a later block useless without its
  parents).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

ReplicaKey = Hashable


class PrefixIndex:
    """Block hash -> replicas it was recently routed to, bounded to `capacity` hashes (least
    recently recorded evicted first)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._holders: OrderedDict[bytes, set[ReplicaKey]] = OrderedDict()
        self._by_replica: dict[ReplicaKey, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, replica: ReplicaKey, hashes: Iterable[bytes]) -> None:
        held = self._by_replica.setdefault(replica, set())
        for digest in hashes:
            holders = self._holders.get(digest)
            if holders is None:
                holders = self._holders[digest] = set()
            else:
                self._holders.move_to_end(digest)
            holders.add(replica)
            held.add(digest)
        while len(self._holders) > self.capacity:
            digest, holders = self._holders.popitem(last=False)
            for holder in holders:
                self._by_replica[holder].discard(digest)

    def forget(self, replica: ReplicaKey) -> None:
        for digest in list(self._by_replica.pop(replica, set())):
            self._drop(replica, digest, keep_replica=True)

    def _drop(self, replica: ReplicaKey, digest: bytes, keep_replica: bool = False) -> None:
        holders = self._holders.get(digest)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[digest]
        if not keep_replica:
            self._by_replica[replica].discard(digest)

    def longest_prefixes(self, hashes: Sequence[bytes]) -> dict[ReplicaKey, int]:
        """Replica -> leading blocks of `hashes` it holds (replicas holding none are absent)."""
        lengths: dict[ReplicaKey, int] = {}
        current: set[ReplicaKey] | None = None
        for index, digest in enumerate(hashes):
            holders = self._holders.get(digest, set())
            current = set(holders) if current is None else current & holders
            if not current:
                break
            for replica in current:
                lengths[replica] = index + 1
        return lengths
