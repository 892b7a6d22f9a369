"""One tier of physical KV blocks with reference counts and an intrusive LRU free queue.

Invariants (checked by `block_manager.integrity`):
- a block is in the free queue iff its reference count is 0;
- the free queue is a doubly linked list threaded through the preallocated ``_prev``/``_next``
  arrays (index ``num_blocks`` is the sentinel), so removal from the middle is O(1) and no operation
  allocates a node;
- the front of the queue is reused first: unsealed blocks are pushed to the front when freed,
  sealed (cached) blocks to the back, so cached blocks are evicted least-recently-freed first;
- a sealed block has its chain hash in ``hashes[b]`` and the hash's preimage in ``keys[b]``, and
  ``cached[keys[b]] == b``: it stays findable while free ("evictable cached") until it is popped
  for reuse. The index is keyed by the exact preimage (parent hash, token bytes, extra keys), so a
  prefix lookup compares bytes exactly and computes no sha256 for a hit; which blocks match never
  depends on Python's per-process ``hash()`` (a dict only uses it to place keys);
- ``generations[b]`` grows by one every time ``b`` is taken from the free queue (the only way a
  block gets new contents: a sealed block is never written, an unsealed one only by its holder),
  so a copy that recorded ``generations[b]`` can tell later whether ``b`` changed since;
- when ``on_evict`` is set, it is called with (block, preimage, hash) just before a cached block
  is reused, while its contents are still intact (the CPU tier demotes it there).
"""

from __future__ import annotations

from collections.abc import Callable

from block_manager.errors import NoFreeBlocks, Tier
from block_manager.events import BlockEvent

_NOT_QUEUED = -1


class BlockPool:
    """Physical blocks ``0 .. num_blocks-1`` of one tier (device or CPU)."""

    __slots__ = (
        "_next",
        "_prev",
        "cached",
        "events",
        "generations",
        "hashes",
        "keys",
        "num_blocks",
        "num_free",
        "num_free_cached",
        "on_evict",
        "ref_counts",
        "sentinel",
        "tier",
    )

    def __init__(self, tier: Tier, num_blocks: int) -> None:
        self.tier: Tier = tier
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.keys: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.generations: list[int] = [0] * num_blocks
        self.on_evict: Callable[[int, bytes, bytes], None] | None = None
        self.sentinel = num_blocks
        # Initially every block is free, in id order; the sentinel closes the ring.
        if num_blocks:
            self._prev: list[int] = [num_blocks, *range(num_blocks - 1), num_blocks - 1]
            self._next: list[int] = [*range(1, num_blocks), num_blocks, 0]
        else:
            self._prev, self._next = [0], [0]
        self.num_free = num_blocks
        self.num_free_cached = 0
        self.events: list[BlockEvent] | None = None
        """Where seals and evictions are recorded (`BlockEvent`), when someone listens."""

    # --- free queue primitives (O(1), no allocation)
    def _unlink(self, block: int) -> None:
        prev, nxt = self._prev, self._next
        before, after = prev[block], nxt[block]
        nxt[before] = after
        prev[after] = before
        prev[block] = nxt[block] = _NOT_QUEUED
        self.num_free -= 1

    def _push_back(self, block: int) -> None:
        prev, nxt, sentinel = self._prev, self._next, self.sentinel
        last = prev[sentinel]
        nxt[last] = block
        prev[block] = last
        nxt[block] = sentinel
        prev[sentinel] = block
        self.num_free += 1

    def _push_front(self, block: int) -> None:
        prev, nxt, sentinel = self._prev, self._next, self.sentinel
        first = nxt[sentinel]
        prev[first] = block
        nxt[block] = first
        prev[block] = sentinel
        nxt[sentinel] = block
        self.num_free += 1

    # --- operations used by the manager
    def pop_free(self) -> int:
        """Take the block at the front of the free queue (evicting its cached hash); ref count 1.

        The caller must have checked ``num_free > 0``.
        """
        block = self._next[self.sentinel]
        self._unlink(block)
        old = self.keys[block]
        if old is not None:
            self._evict(block, old)
        self.ref_counts[block] = 1
        self.generations[block] += 1
        return block

    def _evict(self, block: int, key: bytes) -> None:
        """Forget the hash of a cached block that is being reused (after `on_evict`, if set)."""
        digest = self.hashes[block]
        assert digest is not None
        if self.events is not None:
            self.events.append(BlockEvent(False, digest, self.tier))
        if self.on_evict is not None:
            self.on_evict(block, key, digest)
        del self.cached[key]
        self.keys[block] = self.hashes[block] = None
        self.num_free_cached -= 1

    def require_free(self, count: int, keep_free: int, reason: str) -> None:
        """Raise NoFreeBlocks (`reason`, nothing taken) unless `count` blocks are free beyond the
        `keep_free` the caller holds back (the manager's watermark): the one admission check
        that every taker of fresh blocks with a watermark shares."""
        available = self.num_free - keep_free
        if count > available:
            raise NoFreeBlocks(
                f"{reason} (watermark {keep_free} kept free)",
                needed=count,
                available=max(available, 0),
                tier=self.tier,
            )

    def pop_many(self, count: int) -> list[int]:
        """Take `count` blocks from the front of the free queue (one cut of the list), ref 1 each.

        The caller must have checked ``num_free >= count``.
        """
        prev, nxt, refs, keys = self._prev, self._next, self.ref_counts, self.keys
        gens = self.generations
        taken: list[int] = []
        block = nxt[self.sentinel]
        for _ in range(count):
            taken.append(block)
            old = keys[block]
            if old is not None:
                self._evict(block, old)
            refs[block] = 1
            gens[block] += 1
            following = nxt[block]
            prev[block] = nxt[block] = _NOT_QUEUED
            block = following
        nxt[self.sentinel] = block
        prev[block] = self.sentinel
        self.num_free -= count
        return taken

    def acquire(self, block: int, count: int = 1) -> None:
        """Add `count` references to `block`, taking it out of the free queue if it was free."""
        if self.ref_counts[block] == 0:
            self._unlink(block)
            if self.hashes[block] is not None:
                self.num_free_cached -= 1
        self.ref_counts[block] += count

    def acquire_run(self, blocks: list[int]) -> None:
        """`acquire` each block once."""
        refs, hashes = self.ref_counts, self.hashes
        for block in blocks:
            if refs[block] == 0:
                self._unlink(block)
                if hashes[block] is not None:
                    self.num_free_cached -= 1
            refs[block] += 1

    def release(self, block: int, count: int = 1) -> None:
        """Drop `count` references; at zero the block joins the free queue (cached at the back)."""
        refs = self.ref_counts[block] - count
        self.ref_counts[block] = refs
        if refs == 0:
            if self.hashes[block] is not None:
                self._push_back(block)
                self.num_free_cached += 1
            else:
                self._push_front(block)

    def release_run(self, blocks: list[int]) -> None:
        """`release` each block once, in the given order."""
        refs, hashes = self.ref_counts, self.hashes
        for block in blocks:
            count = refs[block] - 1
            refs[block] = count
            if count == 0:
                if hashes[block] is not None:
                    self._push_back(block)
                    self.num_free_cached += 1
                else:
                    self._push_front(block)

    def seal(self, block: int, key: bytes, block_hash: bytes) -> None:
        """Register `block` under its hash preimage `key`; no other block may hold that key."""
        assert self.keys[block] is None and key not in self.cached
        self.cached[key] = block
        self.keys[block] = key
        self.hashes[block] = block_hash
        if self.events is not None:
            self.events.append(BlockEvent(True, block_hash, self.tier))

    def unseal(self, block: int) -> None:
        """Make a sealed block unfindable without reusing it (its KV must not be served)."""
        key = self.keys[block]
        assert key is not None
        digest = self.hashes[block]
        assert digest is not None
        if self.events is not None:
            self.events.append(BlockEvent(False, digest, self.tier))
        del self.cached[key]
        self.keys[block] = self.hashes[block] = None
        if self.ref_counts[block] == 0:  # an unsealed free block belongs at the front
            self._unlink(block)
            self.num_free_cached -= 1
            self._push_front(block)

    def touch(self, block: int) -> None:
        """Move a free cached block to the back of the queue (most recently used)."""
        if self.ref_counts[block] == 0:
            self._unlink(block)
            self._push_back(block)

    # --- read-only views (tests, integrity, pressure)
    def free_queue(self) -> list[int]:
        """Block ids in the free queue, front (reused first) to back; stops after num_blocks + 1."""
        order: list[int] = []
        block = self._next[self.sentinel]
        while block != self.sentinel and len(order) <= self.num_blocks:
            order.append(block)
            block = self._next[block]
        return order

    def links(self, block: int) -> tuple[int, int]:
        """(previous, next) of `block` in the free queue, or (-1, -1) when it is not queued."""
        return self._prev[block], self._next[block]
