"""`KVCacheManager`: paged KV bookkeeping for the scheduler (the contract the engine codes against).

It owns a device pool and a CPU swap pool (`BlockPool`), one `BlockTable` per sequence and the
counters behind `pressure()`. It only plans: block ids, slot numbers, copy-on-write and swap pairs
that the workers execute. Every mutation checks everything first and then commits, so it either
succeeds whole or raises with nothing changed.

Sharing rules: a full block is shared only once its KV is computed and sealed under its chain hash
(prefix hits) or by `fork`; a partial tail is shared only by `fork` and the first write to it is a
copy-on-write, so a block is written only by a sequence that holds it alone.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NamedTuple

from block_manager.cache_key import CacheKey
from block_manager.errors import InvalidOperation, NeverFits, NoFreeBlocks
from block_manager.identity import (
    block_suffix,
    check_hash_seed,
    check_unsalted_blocks,
    encode_extra_keys,
    match_cached_prefix,
    new_token_array,
    tokens_to_bytes,
)
from block_manager.manager_views import CacheViews
from block_manager.pool import BlockPool
from block_manager.prompt_blocks import cacheable_blocks
from block_manager.protocol import TableDelta
from block_manager.swap import SwapCounters, plan_swap_in, plan_swap_out
from block_manager.table import BlockTable
from block_manager.tiers import CpuHits, CpuTier
from block_manager.transfer_leases import TransferLeases
from block_manager.types import BlockCopy, SeqId
from block_manager.validation import (
    check_manager_sizes,
    check_new_seq_id,
    swap_group,
)

_sha256 = hashlib.sha256


class _Prompt(NamedTuple):
    tokens: array
    seed: bytes
    suffix: bytes
    unsalted_blocks: int
    cpu_hits: CpuHits | None = None


class KVCacheManager(CacheViews):
    """Two-tier paged KV cache manager with prefix caching, copy-on-write and swap planning.

    Satisfies `block_manager.KVManager` and its optional pieces (`CacheTier`,
    `BlockEventSource`). Its read-only views (pressure, usage, cached hashes, events, integrity)
    and the CPU cache tier's hooks are in `block_manager.manager_views`.
    """

    __slots__ = (
        "_block_size",
        "_caching",
        "_count_prefix",
        "_cow_copies",
        "_cpu",
        "_device",
        "_device_refs",
        "_leases",
        "_mask",
        "_prefix_hit_tokens",
        "_prefix_query_tokens",
        "_shift",
        "_swaps",
        "_tables",
        "_tier",
        "_watermark",
    )

    def __init__(
        self,
        *,
        num_device_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark_blocks: int = 0,
        record_events: bool = False,
        cpu_cache: bool = False,
    ) -> None:
        """`record_events`: keep a `BlockEvent` for every seal and eviction in either tier, for
        `take_events` (a cluster-wide index follows the cache from them). `cpu_cache`: the CPU
        pool is also a cache tier (`block_manager.tiers`; needs prefix caching and CPU blocks);
        off, the CPU pool only holds swapped-out sequences, as it always did."""
        check_manager_sizes(num_device_blocks, num_cpu_blocks, block_size, watermark_blocks)
        self._block_size = block_size
        self._shift = block_size.bit_length() - 1
        self._mask = block_size - 1
        self._count_prefix = block_size.to_bytes(4, "little")  # u32le token count of a block
        self._caching = bool(enable_prefix_caching)
        self._watermark = watermark_blocks
        self._device = BlockPool("device", num_device_blocks)
        self._device_refs = self._device.ref_counts  # the same list, for the decode hot path
        self._cpu = BlockPool("cpu", num_cpu_blocks)
        if record_events:
            self._device.events = self._cpu.events = []
        self._tables: dict[SeqId, BlockTable] = {}
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._cow_copies = 0
        self._swaps = SwapCounters()
        self._tier = (
            CpuTier(self._device, self._cpu)
            if cpu_cache and self._caching and num_cpu_blocks > 0
            else None
        )
        self._leases = TransferLeases(self._device, self._cpu, self._tier, watermark_blocks)

    # ------------------------------------------------------------------ queries
    def take_table_delta(self, seq_id: SeqId) -> TableDelta:
        """What changed in the block table since the last call: ``(start, blocks)`` such that
        the workers' copy truncated to `start` and extended by `blocks` is `block_table(seq_id)`.

        A copy-on-write or a sealing dedup that replaces block i lowers `start` to i; `allocate`,
        `fork`, `free` and `swap_out` reset the workers' view, so the next delta is the whole table.
        """
        table = self._tables.get(seq_id)
        if table is None or table.on_cpu is not None:
            raise self._not_resident(seq_id, "read the block table of")
        start, blocks = table.synced, table.block_ids
        table.synced = len(blocks)
        return start, blocks[start:]

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Slot (block * block_size + offset) of each position in ``[start, end)``."""
        table = self._tables.get(seq_id)
        if table is None or table.on_cpu is not None:
            raise self._not_resident(seq_id, "map slots of")
        if end - start == 1 and 0 <= start < len(table.tokens):
            shift = self._shift
            return [(table.block_ids[start >> shift] << shift) | (start & self._mask)]
        if not 0 <= start <= end <= len(table.tokens):
            raise InvalidOperation(
                f"slot range [{start}, {end}) is outside sequence {seq_id!r} "
                f"of {len(table.tokens)} tokens"
            )
        if start == end:
            return []
        blocks, shift, mask = table.block_ids, self._shift, self._mask
        first, last = start >> shift, (end - 1) >> shift
        base = blocks[first] << shift
        if first == last:
            return list(range(base | (start & mask), base + ((end - 1) & mask) + 1))
        size = self._block_size
        slots = list(range(base | (start & mask), base + size))
        for block in blocks[first + 1 : last]:
            base = block << shift
            slots.extend(range(base, base + size))
        base = blocks[last] << shift
        slots.extend(range(base, base + ((end - 1) & mask) + 1))
        return slots

    def _plan_allocation(
        self, token_ids: Sequence[int], key: CacheKey
    ) -> tuple[_Prompt, list[int], list[bytes], int]:
        """Validated prompt, cache hits (blocks, hashes) and blocks needed from the free queue.

        Only `prompt_blocks.cacheable_blocks` leading blocks are looked up (the shared rule).
        """
        tokens = new_token_array(token_ids)
        if not tokens:
            raise InvalidOperation("cannot allocate an empty sequence (no tokens)")
        seed = check_hash_seed(key.hash_seed)
        suffix = encode_extra_keys(key.extra_keys)
        unsalted = check_unsalted_blocks(key.unsalted_blocks, len(tokens) >> self._shift)
        if self._caching:
            hit_blocks, hit_hashes = match_cached_prefix(
                self._device.cached,
                self._device.hashes,
                seed,
                tokens_to_bytes(tokens),
                self._block_size,
                suffix,
                cacheable_blocks(len(tokens), self._block_size),
                unsalted,
            )
        else:
            hit_blocks, hit_hashes = [], []
        total = (len(tokens) + self._mask) >> self._shift
        refs = self._device.ref_counts
        reclaimed = sum(1 for block in hit_blocks if refs[block] == 0)
        needed = total - len(hit_blocks) + reclaimed
        cpu_hits = None
        if self._tier is not None:  # CPU hits continue the chain; each needs a fresh block
            cpu_hits = self._tier.match(
                hit_hashes[-1] if hit_hashes else seed,
                tokens_to_bytes(tokens),
                len(hit_hashes),
                cacheable_blocks(len(tokens), self._block_size),
                self._block_size,
                suffix,
                unsalted,
            )
            if cpu_hits.blocks:
                hit_hashes = hit_hashes + cpu_hits.hashes
        prompt = _Prompt(tokens, seed, suffix, unsalted, cpu_hits)
        return prompt, hit_blocks, hit_hashes, needed

    def blocks_needed_to_allocate(self, token_ids: Sequence[int], key: CacheKey) -> int:
        """Blocks `allocate` would take out of the free queue (new ones plus reused cached ones)."""
        return self._plan_allocation(token_ids, key)[3]

    def cached_prefix_tokens(self, token_ids: Sequence[int], key: CacheKey) -> int:
        """Tokens `allocate` would find cached now (what its return value would be)."""
        return len(self._plan_allocation(token_ids, key)[2]) << self._shift

    def can_allocate(self, token_ids: Sequence[int], key: CacheKey) -> bool:
        """Whether `allocate` would succeed now, keeping `watermark_blocks` free."""
        needed = self.blocks_needed_to_allocate(token_ids, key)
        total = (len(token_ids) + self._mask) >> self._shift
        return total <= self.num_device_blocks and needed <= self._device.num_free - self._watermark

    def _blocks_to_append(self, seq_ids: Sequence[SeqId]) -> int:
        """Blocks one more token for each of `seq_ids` needs (new tails plus copy-on-writes)."""
        refs = self._device.ref_counts
        mask = self._mask
        needed = 0
        writers: dict[int, int] = {}
        for seq_id in seq_ids:
            table = self._resident(seq_id, "append to")
            if len(table.tokens) & mask == 0:
                needed += 1
            else:
                tail = table.block_ids[-1]
                if refs[tail] > 1:
                    writers[tail] = writers.get(tail, 0) + 1
        for tail, count in writers.items():
            # Every writer but the last one to write copies; the last keeps the original.
            needed += count - 1 if count == refs[tail] else count
        return needed

    def can_append(self, seq_ids: Sequence[SeqId]) -> bool:
        """Whether one more token for each of `seq_ids` fits now (the watermark may be used)."""
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidOperation(f"duplicate sequence ids in {list(seq_ids)!r}")
        return self._blocks_to_append(seq_ids) <= self._device.num_free

    def can_swap_out(self, seq_ids: Sequence[SeqId]) -> bool:
        return plan_swap_out(
            self._device, self._cpu, swap_group(self._tables, seq_ids, swapped=False)
        ).fits

    def can_swap_in(self, seq_ids: Sequence[SeqId]) -> bool:
        plan = plan_swap_in(
            self._device,
            self._cpu,
            swap_group(self._tables, seq_ids, swapped=True),
            self._watermark,
            self._block_size,
        )
        return plan.fits

    # ------------------------------------------------------------------ mutations
    def allocate(self, seq_id: SeqId, token_ids: Sequence[int], key: CacheKey) -> int:
        """New table for `token_ids`; shares the longest cached prefix; returns cached tokens.

        The first `key.unsalted_blocks` full blocks (an operator-shared prefix such as a system
        prompt) are hashed without `key.extra_keys`, so sequences with other extra keys (tenants)
        share them; every later block carries them. The table remembers the split.
        """
        check_new_seq_id(self._tables, seq_id)
        prompt, hit_blocks, hit_hashes, needed = self._plan_allocation(token_ids, key)
        tokens = prompt.tokens
        pool = self._device
        total = (len(tokens) + self._mask) >> self._shift
        if total > pool.num_blocks:
            raise NeverFits(
                f"sequence {seq_id!r} of {len(tokens)} tokens needs more blocks than the device "
                f"pool has",
                needed=total,
                available=pool.num_blocks,
            )
        pool.require_free(needed, self._watermark, f"cannot allocate sequence {seq_id!r}")
        pool.acquire_run(hit_blocks)
        cpu_hits = prompt.cpu_hits
        if cpu_hits is not None:
            self._tier_commit(cpu_hits, len(hit_blocks))
        blocks = hit_blocks
        blocks += pool.pop_many(total - len(hit_blocks))
        cached_tokens = len(hit_hashes) << self._shift
        if cpu_hits is not None and cpu_hits.blocks:
            first = len(hit_hashes) - len(cpu_hits.blocks)
            assert self._tier is not None
            self._tier.promote_into(cpu_hits, blocks[first : len(hit_hashes)])
        self._tables[seq_id] = BlockTable(
            tokens,
            blocks,
            num_computed=cached_tokens,
            hashes=hit_hashes,
            hash_seed=prompt.seed,
            hash_suffix=prompt.suffix,
            unsalted_blocks=prompt.unsalted_blocks,
        )
        self._prefix_query_tokens += len(tokens)
        self._prefix_hit_tokens += cached_tokens
        return cached_tokens

    def append_token(self, seq_id: SeqId, token_id: int) -> BlockCopy | None:
        """Add one token (computed next step); returns the copy a copy-on-write needs, if any."""
        table = self._tables.get(seq_id)
        if table is None or table.on_cpu is not None:
            raise self._not_resident(seq_id, "append to")
        tokens = table.tokens
        offset = len(tokens) & self._mask
        if offset and self._device_refs[table.block_ids[-1]] == 1:
            try:  # the common case: the tail is ours and has room
                tokens.append(token_id)
            except (OverflowError, TypeError):
                raise self._bad_token(token_id) from None
            return None
        pool = self._device
        if pool.num_free == 0:
            raise NoFreeBlocks(
                f"no block for the next token of sequence {seq_id!r}"
                + (" (copy-on-write of its shared tail)" if offset else ""),
                needed=1,
                available=0,
                tier="device",
            )
        try:
            tokens.append(token_id)
        except (OverflowError, TypeError):
            raise self._bad_token(token_id) from None
        block = pool.pop_free()
        if offset == 0:
            table.block_ids.append(block)
            return None
        # The tail is shared (fork): the writer gets a private copy; the others keep the original.
        tail = table.block_ids[-1]
        pool.release(tail)
        table.block_ids[-1] = block
        table.synced = min(table.synced, len(table.block_ids) - 1)
        self._cow_copies += 1
        return BlockCopy(src=tail, dst=block, num_tokens=offset)

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Drop the tokens past `num_tokens` and the blocks that only they used (rejected
        speculative tokens). Only uncomputed tokens past the operator-shared prefix can go, so
        the dropped blocks were never sealed, and they were appended after any fork, so the
        sequence holds them alone: they go straight back to the free queue. The kept tail
        stays the sequence's own (an append already copied it if it was shared)."""
        table = self._resident(seq_id, "truncate")
        least = max(table.num_computed, 1, table.unsalted_blocks << self._shift)
        if type(num_tokens) is not int or not least <= num_tokens <= len(table.tokens):
            raise InvalidOperation(
                f"cannot truncate sequence {seq_id!r} to {num_tokens!r} tokens: it has "
                f"{len(table.tokens)} and must keep at least {least} (its computed tokens, "
                "its operator-shared prefix and one token)"
            )
        keep = (num_tokens + self._mask) >> self._shift
        dropped = table.block_ids[keep:]
        del table.tokens[num_tokens:]
        del table.block_ids[keep:]
        table.synced = min(table.synced, keep)
        self._device.release_run(dropped[::-1])

    def replace_token(self, seq_id: SeqId, position: int, token_id: int) -> None:
        """Sets the id of the uncomputed token at `position` (async scheduling appends a
        placeholder for a token still being sampled). Blocks are untouched: only computed
        tokens are ever hashed, so no seal saw the old id."""
        table = self._resident(seq_id, "replace a token of")
        if type(position) is not int or not table.num_computed <= position < len(table.tokens):
            raise InvalidOperation(
                f"cannot replace token {position!r} of sequence {seq_id!r}: only its uncomputed "
                f"tokens [{table.num_computed}, {len(table.tokens)}) can be replaced"
            )
        try:
            table.tokens[position] = token_id
        except (OverflowError, TypeError):
            raise self._bad_token(token_id) from None

    def _tier_commit(self, cpu_hits: CpuHits, device_hits: int) -> None:
        """Pin the CPU hits (before device pops can demote into the CPU tier) and count hits."""
        assert self._tier is not None
        self._tier.pin_hits(cpu_hits)
        counters = self._tier.counters
        counters.device_hit_tokens += device_hits << self._shift
        counters.cpu_hit_tokens += len(cpu_hits.blocks) << self._shift

    @staticmethod
    def _bad_token(token_id: object) -> InvalidOperation:
        return InvalidOperation(f"token id must be an integer in [0, 2**32), got {token_id!r}")

    def mark_computed(self, seq_id: SeqId, num_computed_tokens: int) -> None:
        """The KV of the first `num_computed_tokens` tokens is cached; seal the full blocks."""
        table = self._tables.get(seq_id)
        if table is None or table.on_cpu is not None:
            raise self._not_resident(seq_id, "mark computed")
        if type(num_computed_tokens) is not int or not (
            table.num_computed <= num_computed_tokens <= len(table.tokens)
        ):
            raise InvalidOperation(
                f"num_computed_tokens {num_computed_tokens!r} for sequence {seq_id!r} must be in "
                f"[{table.num_computed}, {len(table.tokens)}]"
            )
        table.num_computed = num_computed_tokens
        if self._caching and num_computed_tokens >> self._shift > len(table.hashes):
            self._seal(table, num_computed_tokens >> self._shift)

    def _seal(self, table: BlockTable, num_full: int) -> None:
        """Hash full computed blocks ``len(table.hashes) .. num_full-1`` and register them.

        The preimage is `identity.block_key`'s layout, built inline because decode seals one
        block every `block_size` tokens (`check_integrity` recomputes it with `chain_blocks`).
        If another device block already holds the same preimage (two sequences computed the same
        content), the table switches to that block and frees its own: identical KV, one copy,
        and every sealed device block stays findable.
        """
        hashes, size = table.hashes, self._block_size
        first = len(hashes)
        data = tokens_to_bytes(table.tokens[first * size : num_full * size])
        prefix, suffix, width = self._count_prefix, table.hash_suffix, size * 4
        unsalted = table.unsalted_blocks
        parent = hashes[-1] if hashes else table.hash_seed
        pool, blocks = self._device, table.block_ids
        cached = pool.cached
        for index in range(first, num_full):
            start = (index - first) * width
            extra = suffix if index >= unsalted else block_suffix(index, suffix, unsalted)
            key = parent + prefix + data[start : start + width] + extra
            parent = _sha256(key).digest()
            hashes.append(parent)
            holder = cached.get(key)
            if holder is None:
                pool.seal(blocks[index], key, parent)
            else:
                pool.acquire(holder)
                pool.release(blocks[index])
                blocks[index] = holder
                table.synced = min(table.synced, index)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """`child_id` shares every block of `parent_id` (same tokens, same computed count)."""
        parent = self._resident(parent_id, "fork")
        check_new_seq_id(self._tables, child_id)
        if parent.num_computed != len(parent.tokens):
            raise InvalidOperation(
                f"cannot fork sequence {parent_id!r} with uncomputed tokens "
                f"({parent.num_computed} of {len(parent.tokens)} computed): two writers would "
                "share their slots; fork after mark_computed"
            )
        acquire = self._device.acquire
        for block in parent.block_ids:
            acquire(block)
        self._tables[child_id] = parent.fork()

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence; its sealed blocks stay hit-able (tail blocks are evicted first)."""
        table = self._table(seq_id)
        del self._tables[seq_id]
        on_cpu = table.on_cpu
        device, cpu = self._device, self._cpu
        # Release in reverse so a sequence's later blocks sit before its prefix in LRU order.
        if on_cpu is None:
            device.release_run(table.block_ids[::-1])
            return
        for block, is_cpu in zip(reversed(table.block_ids), reversed(on_cpu), strict=True):
            (cpu if is_cpu else device).release(block)

    def swap_out(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int]]:
        """Move the group's blocks nobody else holds to the CPU; returns (device, cpu) pairs."""
        group = swap_group(self._tables, seq_ids, swapped=False)
        pairs = plan_swap_out(self._device, self._cpu, group).commit(self._swaps)
        for table in group:
            table.synced = 0  # the workers drop a swapped-out sequence
        return pairs

    def swap_in(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int]]:
        """Bring the group's CPU blocks back to the device; returns (cpu, device) copy pairs."""
        plan = plan_swap_in(
            self._device,
            self._cpu,
            swap_group(self._tables, seq_ids, swapped=True),
            self._watermark,
            self._block_size,
        )
        tier = self._tier
        if tier is None:
            return plan.commit(self._swaps)
        pairs = plan.commit(self._swaps, tier.defer_release)
        tier.incoming.update(device for _, device in pairs)
        return pairs
