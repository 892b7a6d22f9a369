"""Which replica holds which KV blocks: the block hash chain of a prompt, a replica's bounded
record of the blocks it computed, and the router's bounded index over all replicas.

Block hashes are exactly the block manager's: `block_manager.block_hash` chained from the
request's `CacheIdentity.digest()` seed, with the request's extra keys (the tenant salt) in every
block, so two prompts map to the same hash only when the engine would share that block. Nothing
here compares text.

Invariants:
- `prompt_block_hashes` yields only the blocks the engine can match from its cache: full blocks
  that do not hold the prompt's last token;
- `PublishedBlocks` and `PrefixIndex` never hold more than their capacity (least recently seen
  entries go first);
- `PrefixIndex.longest_prefixes` gives each replica the number of leading blocks of the chain it
  holds, all of them, without a gap (a hash chain makes a later block useless without its
  parents).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

import block_manager
from block_manager import CacheKey
from cluster.engine.generate_request import leading_shared_tokens

ReplicaKey = Hashable


def prompt_block_hashes(
    token_ids: Sequence[int],
    *,
    hash_seed: bytes,
    extra_keys: Sequence[bytes | str],
    block_size: int,
    shared_prefix_blocks: int = 0,
) -> list[bytes]:
    """The chain hashes of the prompt's cacheable blocks (`block_manager.prompt_block_hashes`,
    the one rule the engine's block manager follows too).

    The first `shared_prefix_blocks` blocks are hashed without `extra_keys` (an operator-shared
    system prompt, the same for every tenant); the rest with them. With the default 0 this is
    exactly the engine's chain.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if shared_prefix_blocks < 0:
        raise ValueError(f"shared_prefix_blocks must be >= 0, got {shared_prefix_blocks}")
    key = CacheKey(hash_seed, extra_keys, shared_prefix_blocks)
    return block_manager.prompt_block_hashes(token_ids, key, block_size)


def shared_prefix_blocks(
    token_ids: Sequence[int], shared_prefixes: Iterable[Sequence[int]], block_size: int
) -> int:
    """Whole blocks at the start of the prompt that are tokens of an operator-shared prefix
    (`leading_shared_tokens`, the engine's own rule, in blocks)."""
    return leading_shared_tokens(token_ids, shared_prefixes, block_size) // block_size


class PublishedBlocks:
    """A replica's record of the block hashes its engine computed, newest last, at most
    `capacity` of them; what the replica publishes to the routers."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def add(self, hashes: Iterable[bytes]) -> None:
        for digest in hashes:
            self._hashes[digest] = None
            self._hashes.move_to_end(digest)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def snapshot(self) -> list[bytes]:
        return list(self._hashes)

    def __len__(self) -> int:
        return len(self._hashes)


class PrefixIndex:
    """Block hash -> replicas holding it, bounded to `capacity` hashes (least recently recorded
    evicted first). `sync` applies a replica's publication; `record` adds what the router just
    sent it (so a repeat arriving before the next publication follows)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._holders: OrderedDict[bytes, set[ReplicaKey]] = OrderedDict()
        self._by_replica: dict[ReplicaKey, set[bytes]] = {}
        self._published: dict[ReplicaKey, set[bytes]] = {}

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

    def sync(self, replica: ReplicaKey, published: Iterable[bytes]) -> None:
        """A new publication of the replica (oldest first): what it published before and no
        longer does is dropped; what a router recorded but the replica has not published yet
        stays (the publication may predate the request)."""
        published = list(published)
        now = set(published)
        for digest in self._published.get(replica, set()) - now:
            if digest in self._by_replica.get(replica, set()):
                self._drop(replica, digest)
        self._published[replica] = now
        self.record(replica, published)

    def forget(self, replica: ReplicaKey) -> None:
        self._published.pop(replica, None)
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

    def replicas(self) -> set[ReplicaKey]:
        return {r for r, held in self._by_replica.items() if held}

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
