"""What the block manager tells the rest of the cluster about its cache: block events.

A `BlockEvent` says that a block with an exact chain hash became findable (`stored`: sealed) or
stopped being findable (`stored` False: evicted for reuse) in one tier of this manager's pools.
They are produced where the pool changes, O(changes) per step, never by scanning a pool, and a
consumer that applies them in order to an empty set holds exactly the hashes the manager can hit
(`KVCacheManager.cached_hashes_by_tier()` gives the same set by a full scan, for resyncs).
"""

from __future__ import annotations

from typing import NamedTuple

from block_manager.errors import Tier


class BlockEvent(NamedTuple):
    """One change of the findable set: `block_hash` stored in or removed from `tier`."""

    stored: bool
    block_hash: bytes
    tier: Tier
