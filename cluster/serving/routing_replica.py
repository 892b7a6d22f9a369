"""The replica side of prefix-aware routing: what one replica publishes to the routers.

`ReplicaBlocks` publishes the block hashes the replica's engine actually holds cached on the
device (`AsyncEngine.cached_block_hashes`, evictable blocks included), at most `capacity` of
them; Serve collects them through the replica's `record_routing_stats` (see
`cluster.serving.routing`).

Invariants:
- a published hash is one the engine's block manager holds sealed at publication time (it may
  be evicted before the router uses it: that costs a recompute, never a wrong answer);
- `version` changes exactly when the published set does, so routers resync only then.
"""

from __future__ import annotations

from typing import Any

from cluster.engine.async_engine import AsyncEngine
from cluster.serving.routing import LoadReport, routing_stats


class ReplicaBlocks:
    """What one replica publishes to the routers."""

    def __init__(self, engine: AsyncEngine, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.engine = engine
        self.capacity = capacity
        self.version = 0
        self._published: frozenset[bytes] = frozenset()

    def published(self) -> list[bytes]:
        """The cached block hashes to publish, least valuable first (the router's bounded index
        keeps the last ones longest): evictable blocks evicted soonest first, in-use ones last."""
        newest_last = self.engine.cached_block_hashes(self.capacity)[::-1]
        current = frozenset(newest_last)
        if current != self._published:
            self._published = current
            self.version += 1
        return newest_last

    def routing_stats(self) -> dict[str, Any]:
        hashes = self.published()
        return routing_stats(hashes, LoadReport.of(self.engine.metrics()), self.version)
