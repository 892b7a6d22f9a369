"""`HybridKVManager`: paged KV bookkeeping with one block table per KV group over one pool.

The coordinator of `workers.kv_groups`: a model's layers are grouped by attention kind
(full attention; a sliding window of `w` tokens), every group keeps its own block table per
sequence (`block_manager.hybrid_state.HybridSeq`), and all of them take blocks from ONE
shared `BlockPool`, so the split of memory between kinds follows the workload. A sliding
group hands back the blocks its window has passed as the sequence is computed (their ids
become the null block, `num_device_blocks - 1`, which is never allocated), so a long sequence
holds `ceil(len / block_size)` blocks in each full group but only about `w / block_size + 1`
in each sliding one.

Everything else is the paged manager's contract (`KVManager`, layout "paged"): a mutation
checks first and commits whole; a sealed block is shared (prefix hits, `fork`) and a shared
partial tail is copied on write, per group; a prefix hit is exact per group: full groups need
every block of the hit, sliding groups only those their window reads from its end
(`first_kept`), and the hit is the longest prefix every group can serve. Swaps move the
non-null blocks of every group. What it does not do (the engine refuses these combinations,
never runs them wrong): the CPU cache tier, block events for a cluster-wide KV index, and
KV transfers between replicas.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from block_manager.cache_key import CacheKey
from block_manager.errors import InvalidOperation, NeverFits, NoFreeBlocks
from block_manager.hybrid_state import HybridSeq, first_kept, group_tag
from block_manager.hybrid_views import HybridViews
from block_manager.identity import (
    block_key,
    block_suffix,
    check_hash_seed,
    check_unsalted_blocks,
    encode_extra_keys,
    new_token_array,
    tokens_to_bytes,
)
from block_manager.pool import BlockPool
from block_manager.prompt_blocks import cacheable_blocks
from block_manager.protocol import TableDelta
from block_manager.swap import SwapCounters
from block_manager.types import BlockCopy, SeqId
from block_manager.validation import check_count, check_manager_sizes

_sha256 = hashlib.sha256


@dataclass
class _Plan:
    """A validated allocation: the prompt, the hit's chain hashes, each group's hit blocks
    (from its `first_kept` on) and the blocks taken out of the free queue."""

    tokens: array
    seed: bytes
    suffix: bytes
    unsalted: int
    hashes: list[bytes]
    hits: list[list[int]]
    needed: int


class HybridKVManager(HybridViews):
    """Per-group block tables over one shared pool (see the module docstring)."""

    def __init__(
        self,
        *,
        windows: Sequence[int | None],
        num_device_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark_blocks: int = 0,
    ) -> None:
        """`windows`: each group's sliding window in tokens (None: full attention), in the
        workers' group order. One device block is the null block, so `num_device_blocks`
        must be at least 2."""
        check_count("num_device_blocks", num_device_blocks, minimum=2)
        check_manager_sizes(num_device_blocks - 1, num_cpu_blocks, block_size, watermark_blocks)
        if not windows or any(
            w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1)
            for w in windows
        ):
            raise InvalidOperation(f"windows must be ints >= 1 or None, got {list(windows)!r}")
        self._windows = tuple(windows)
        self._groups = len(self._windows)
        self._block_size = block_size
        self._shift = block_size.bit_length() - 1
        self._mask = block_size - 1
        self._caching = bool(enable_prefix_caching)
        self._watermark = watermark_blocks
        self._device = BlockPool("device", num_device_blocks - 1)
        self._cpu = BlockPool("cpu", num_cpu_blocks)
        self._null = num_device_blocks - 1
        self._owner = [0] * (num_device_blocks - 1)
        """The group whose table last took each device block (for the per-group counts)."""
        self._seqs: dict[SeqId, HybridSeq] = {}
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._cow_copies = 0
        self._swaps = SwapCounters()

    # ------------------------------------------------------------------ planning
    def _take(self, group: int, count: int) -> list[int]:
        blocks = self._device.pop_many(count)
        owner = self._owner
        for block in blocks:
            owner[block] = group
        return blocks

    def _plan(self, token_ids: Sequence[int], key: CacheKey) -> _Plan:
        """The prompt validated, the longest prefix every group can serve from the cache, and
        the blocks `allocate` takes out of the free queue."""
        tokens = new_token_array(token_ids)
        if not tokens:
            raise InvalidOperation("cannot allocate an empty sequence (no tokens)")
        seed = check_hash_seed(key.hash_seed)
        suffix = encode_extra_keys(key.extra_keys)
        unsalted = check_unsalted_blocks(key.unsalted_blocks, len(tokens) >> self._shift)
        hashes: list[bytes] = []
        hits: list[list[int]] = [[] for _ in self._windows]
        if self._caching:
            hashes, hits = self._match(tokens, seed, suffix, unsalted)
        total = (len(tokens) + self._mask) >> self._shift
        refs = self._device.ref_counts
        needed = 0
        for group, window in enumerate(self._windows):
            kept = total - first_kept(window, len(hashes) << self._shift, self._block_size)
            needed += kept - sum(1 for block in hits[group] if refs[block] > 0)
        return _Plan(tokens, seed, suffix, unsalted, hashes, hits, needed)

    def _match(
        self,
        tokens: array,
        seed: bytes,
        suffix: bytes,
        unsalted: int,
    ) -> tuple[list[bytes], list[list[int]]]:
        """(chain hashes of the hit, each group's hit blocks from its `first_kept` on)."""
        size, cached = self._block_size, self._device.cached
        data = tokens_to_bytes(tokens)
        tags = [group_tag(group) for group in range(self._groups)]
        full = [g for g, window in enumerate(self._windows) if window is None]
        limit = cacheable_blocks(len(tokens), size)
        found: list[list[int | None]] = [[] for _ in self._windows]
        hashes: list[bytes] = []
        parent = seed
        for index in range(limit):
            extra = block_suffix(index, suffix, unsalted)
            preimage = block_key(parent, data[index * size * 4 : (index + 1) * size * 4], extra)
            present = [cached.get(tag + preimage) for tag in tags]
            if any(present[g] is None for g in full):
                break  # a full group's hit ends here, so every group's does
            for group, block in enumerate(present):
                found[group].append(block)
            parent = _sha256(preimage).digest()
            hashes.append(parent)
        for length in range(len(hashes), -1, -1):
            starts = [first_kept(w, length * size, size) for w in self._windows]
            if all(
                all(block is not None for block in found[g][starts[g] : length])
                for g in range(self._groups)
            ):
                hits = [
                    [b for b in found[g][starts[g] : length] if b is not None]
                    for g in range(self._groups)
                ]
                return hashes[:length], hits
        raise AssertionError("the empty prefix is always a hit")

    def blocks_needed_to_allocate(self, token_ids: Sequence[int], key: CacheKey) -> int:
        """Blocks `allocate` would take out of the free queue, over every group."""
        return self._plan(token_ids, key).needed

    def cached_prefix_tokens(self, token_ids: Sequence[int], key: CacheKey) -> int:
        """Tokens `allocate` would find cached now."""
        return len(self._plan(token_ids, key).hashes) << self._shift

    def _peak_blocks(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` uncomputed tokens holds at once: all of them in
        every group until they are computed."""
        return ((num_tokens + self._mask) >> self._shift) * self._groups

    def can_allocate(self, token_ids: Sequence[int], key: CacheKey) -> bool:
        """Whether `allocate` would succeed now, keeping `watermark_blocks` free."""
        plan = self._plan(token_ids, key)
        return (
            self._peak_blocks(len(plan.tokens)) <= self._device.num_blocks
            and plan.needed <= self._device.num_free - self._watermark
        )

    def _blocks_to_append(self, seq_ids: Sequence[SeqId]) -> int:
        """Blocks one more token for each of `seq_ids` needs: a new block in every group at a
        block boundary, else a copy of each shared tail (the last writer keeps the original)."""
        refs, null = self._device.ref_counts, self._null
        needed = 0
        writers: dict[int, int] = {}
        for seq_id in seq_ids:
            seq = self._resident(seq_id, "append to")
            if len(seq.tokens) & self._mask == 0:
                needed += self._groups
                continue
            for table in seq.tables:
                tail = table[-1]
                if tail != null and refs[tail] > 1:
                    writers[tail] = writers.get(tail, 0) + 1
        for tail, count in writers.items():
            needed += count - 1 if count == refs[tail] else count
        return needed

    def can_append(self, seq_ids: Sequence[SeqId]) -> bool:
        """Whether one more token for each of `seq_ids` fits now (the watermark may be used)."""
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidOperation(f"duplicate sequence ids in {list(seq_ids)!r}")
        return self._blocks_to_append(seq_ids) <= self._device.num_free

    # ------------------------------------------------------------------ mutations
    def allocate(self, seq_id: SeqId, token_ids: Sequence[int], key: CacheKey) -> int:
        """New tables for `token_ids` sharing the longest prefix every group can serve;
        returns the cached tokens."""
        self._check_new(seq_id)
        plan = self._plan(token_ids, key)
        tokens, pool = plan.tokens, self._device
        peak = self._peak_blocks(len(tokens))
        if peak > pool.num_blocks:
            raise NeverFits(
                f"sequence {seq_id!r} of {len(tokens)} tokens needs {peak} blocks over "
                f"{self._groups} KV groups, more than the device pool has",
                needed=peak,
                available=pool.num_blocks,
            )
        pool.require_free(plan.needed, self._watermark, f"cannot allocate sequence {seq_id!r}")
        for hits in plan.hits:  # before any pop can evict them
            pool.acquire_run(hits)
        cached = len(plan.hashes) << self._shift
        total = (len(tokens) + self._mask) >> self._shift
        tables, dropped = [], []
        for group, window in enumerate(self._windows):
            start = first_kept(window, cached, self._block_size)
            hits = plan.hits[group]
            fresh = self._take(group, total - start - len(hits))
            tables.append([self._null] * start + hits + fresh)
            dropped.append(start)
        self._seqs[seq_id] = HybridSeq(
            tokens,
            tables,
            dropped,
            num_computed=cached,
            hashes=plan.hashes,
            hash_seed=plan.seed,
            hash_suffix=plan.suffix,
            unsalted_blocks=plan.unsalted,
        )
        self._prefix_query_tokens += len(tokens)
        self._prefix_hit_tokens += cached
        return cached

    def append_token(self, seq_id: SeqId, token_id: int) -> BlockCopy | None:
        """Add one token (computed next step); returns the copies a copy-on-write of shared
        tails needs (one per group, `BlockCopy.pairs`), if any."""
        seq = self._resident(seq_id, "append to")
        offset = len(seq.tokens) & self._mask
        refs, null, pool = self._device.ref_counts, self._null, self._device
        shared = [] if offset == 0 else [
            g for g, table in enumerate(seq.tables) if table[-1] != null and refs[table[-1]] > 1
        ]  # fmt: skip
        needed = self._groups if offset == 0 else len(shared)
        if needed > pool.num_free:
            raise NoFreeBlocks(
                f"no block for the next token of sequence {seq_id!r}"
                + (" (copy-on-write of its shared tails)" if offset else ""),
                needed=needed,
                available=pool.num_free,
                tier="device",
            )
        try:
            seq.tokens.append(token_id)
        except (OverflowError, TypeError):
            raise InvalidOperation(
                f"token id must be an integer in [0, 2**32), got {token_id!r}"
            ) from None
        if offset == 0:
            for group, table in enumerate(seq.tables):
                table.append(self._take(group, 1)[0])
            return None
        pairs = []
        for group in shared:
            table = seq.tables[group]
            tail, block = table[-1], self._take(group, 1)[0]
            pool.release(tail)
            table[-1] = block
            seq.lower_synced(group, len(table) - 1)
            pairs.append((tail, block))
        if not pairs:
            return None
        self._cow_copies += len(pairs)
        return BlockCopy(pairs[0][0], pairs[0][1], offset, tuple(pairs[1:]))

    def mark_computed(self, seq_id: SeqId, num_computed_tokens: int) -> None:
        """The KV of the first `num_computed_tokens` tokens is cached: seal the full blocks in
        every group, then drop the blocks each sliding group's window has passed."""
        seq = self._resident(seq_id, "mark computed")
        if type(num_computed_tokens) is not int or not (
            seq.num_computed <= num_computed_tokens <= len(seq.tokens)
        ):
            raise InvalidOperation(
                f"num_computed_tokens {num_computed_tokens!r} for sequence {seq_id!r} must be in "
                f"[{seq.num_computed}, {len(seq.tokens)}]"
            )
        seq.num_computed = num_computed_tokens
        if self._caching and num_computed_tokens >> self._shift > len(seq.hashes):
            self._seal(seq, num_computed_tokens >> self._shift)
        self._drop_passed(seq)

    def _seal(self, seq: HybridSeq, num_full: int) -> None:
        """Hash full computed blocks `len(hashes) .. num_full - 1` and register each group's
        block under its tagged preimage; a block whose content another block already holds
        is swapped for that one (identical KV, one copy)."""
        pool, cached, size = self._device, self._device.cached, self._block_size
        tags = [group_tag(group) for group in range(self._groups)]
        for index in range(len(seq.hashes), num_full):
            preimage = seq.sealed_key(index, size)
            seq.hashes.append(_sha256(preimage).digest())
            for group, table in enumerate(seq.tables):
                block = table[index]
                if block == self._null:
                    continue
                tagged = tags[group] + preimage
                holder = cached.get(tagged)
                if holder is None:
                    pool.seal(block, tagged, _sha256(tagged).digest())
                elif holder != block:
                    pool.acquire(holder)
                    pool.release(block)
                    table[index] = holder
                    seq.lower_synced(group, index)

    def _drop_passed(self, seq: HybridSeq) -> None:
        """Hand back the blocks no later query of a sliding group reads (`first_kept`)."""
        pool, null = self._device, self._null
        for group, window in enumerate(self._windows):
            if window is None:
                continue
            keep = first_kept(window, seq.num_computed, self._block_size)
            start = seq.dropped[group]
            if keep <= start:
                continue
            table = seq.tables[group]
            for index in range(start, keep):
                pool.release(table[index])
                table[index] = null
            seq.dropped[group] = keep
            seq.lower_synced(group, start)

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Drop the uncomputed tokens past `num_tokens` and the blocks only they used, in
        every group (they were taken after any fork, so the sequence holds them alone)."""
        seq = self._resident(seq_id, "truncate")
        least = max(seq.num_computed, 1, seq.unsalted_blocks << self._shift)
        if type(num_tokens) is not int or not least <= num_tokens <= len(seq.tokens):
            raise InvalidOperation(
                f"cannot truncate sequence {seq_id!r} to {num_tokens!r} tokens: it has "
                f"{len(seq.tokens)} and must keep at least {least} (its computed tokens, "
                "its operator-shared prefix and one token)"
            )
        keep = (num_tokens + self._mask) >> self._shift
        del seq.tokens[num_tokens:]
        for table in seq.tables:
            self._device.release_run(table[keep:][::-1])
            del table[keep:]
        seq.synced = min(seq.synced, keep * self._groups)

    def replace_token(self, seq_id: SeqId, position: int, token_id: int) -> None:
        """Sets the id of the uncomputed token at `position` (blocks are untouched)."""
        seq = self._resident(seq_id, "replace a token of")
        if type(position) is not int or not seq.num_computed <= position < len(seq.tokens):
            raise InvalidOperation(
                f"cannot replace token {position!r} of sequence {seq_id!r}: only its uncomputed "
                f"tokens [{seq.num_computed}, {len(seq.tokens)}) can be replaced"
            )
        try:
            seq.tokens[position] = token_id
        except (OverflowError, TypeError):
            raise InvalidOperation(
                f"token id must be an integer in [0, 2**32), got {token_id!r}"
            ) from None

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """`child_id` shares every block of `parent_id` in every group."""
        parent = self._resident(parent_id, "fork")
        self._check_new(child_id)
        if parent.num_computed != len(parent.tokens):
            raise InvalidOperation(
                f"cannot fork sequence {parent_id!r} with uncomputed tokens "
                f"({parent.num_computed} of {len(parent.tokens)} computed): two writers would "
                "share their slots; fork after mark_computed"
            )
        null = self._null
        for table in parent.tables:
            self._device.acquire_run([block for block in table if block != null])
        self._seqs[child_id] = parent.fork()

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence; its sealed blocks stay hit-able until reused."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        null = self._null
        for group, table in enumerate(seq.tables):
            if seq.on_cpu is None:
                self._device.release_run([b for b in reversed(table) if b != null])
                continue
            for block, is_cpu in zip(reversed(table), reversed(seq.on_cpu[group]), strict=True):
                if is_cpu:
                    self._cpu.release(block)
                elif block != null:
                    self._device.release(block)

    def take_table_delta(self, seq_id: SeqId) -> TableDelta:
        """What changed in the interleaved tables since the last call (see `hybrid_state`)."""
        seq = self._resident(seq_id, "read the block table of")
        start = seq.synced
        blocks = seq.interleaved(start)
        seq.synced = start + len(blocks)
        return start, blocks
