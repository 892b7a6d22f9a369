"""`HybridViews`: what `HybridKVManager` shows without changing a table, and its swaps.

A mixin over the manager's own state (see `block_manager.hybrid`): sizes, sequence lookups,
`pressure` (the shared pool as one tier), `group_usage` (each group's used and evictable
cached blocks), `check_integrity`, and swapping a group of sequences' non-null blocks of every
KV group between the device and the CPU pool.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from block_manager.errors import IntegrityError, InvalidOperation, NoFreeBlocks
from block_manager.hybrid_state import HybridSeq, first_kept, group_tag
from block_manager.identity import chain_blocks, tokens_to_bytes
from block_manager.integrity import check_pool
from block_manager.pool import BlockPool
from block_manager.pressure import PressureSnapshot, tier_pressure
from block_manager.swap import SwapCounters
from block_manager.types import SeqId
from block_manager.validation import unknown_sequence


@dataclass(frozen=True)
class GroupUsage:
    """One KV group's share of the shared device pool: `used` blocks referenced by its
    tables, `cached` unreferenced blocks still findable under its tag, and `free` blocks any
    group may take (the pool's, shared by every group: free plus every group's cached is
    what an allocation can take)."""

    group: int
    window: int | None
    used: int
    cached: int
    free: int


@runtime_checkable
class GroupedKV(Protocol):
    """A manager that keeps several KV groups (the metrics report each one's blocks)."""

    def group_usage(self) -> list[GroupUsage]: ...


class HybridViews:
    """Read-only views and swaps of the hybrid manager (see the module doc)."""

    __slots__ = ()

    _windows: tuple[int | None, ...]
    _groups: int
    _block_size: int
    _caching: bool
    _watermark: int
    _device: BlockPool
    _cpu: BlockPool
    _null: int
    _owner: list[int]
    _seqs: dict[SeqId, HybridSeq]
    _prefix_query_tokens: int
    _prefix_hit_tokens: int
    _cow_copies: int
    _swaps: SwapCounters

    # ------------------------------------------------------------------ attributes
    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_device_blocks(self) -> int:
        """Blocks of the workers' pool, the null block included."""
        return self._device.num_blocks + 1

    @property
    def num_cpu_blocks(self) -> int:
        return self._cpu.num_blocks

    @property
    def watermark_blocks(self) -> int:
        return self._watermark

    @property
    def enable_prefix_caching(self) -> bool:
        return self._caching

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each KV group's sliding window (None: full attention)."""
        return self._windows

    @property
    def null_block(self) -> int:
        """The block id of a dropped table entry (never allocated, never written)."""
        return self._null

    # ------------------------------------------------------------------ lookups
    def _seq(self, seq_id: SeqId) -> HybridSeq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise unknown_sequence(seq_id)
        return seq

    def _resident(self, seq_id: SeqId, action: str) -> HybridSeq:
        seq = self._seq(seq_id)
        if seq.on_cpu is not None:
            raise InvalidOperation(f"cannot {action} sequence {seq_id!r}: it is swapped out")
        return seq

    def _check_new(self, seq_id: SeqId) -> None:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise InvalidOperation(f"sequence id must be an int, got {seq_id!r}")
        if seq_id in self._seqs:
            raise InvalidOperation(f"sequence {seq_id!r} already exists")

    def has_sequence(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: SeqId) -> bool:
        return self._seq(seq_id).on_cpu is not None

    def num_tokens(self, seq_id: SeqId) -> int:
        return len(self._seq(seq_id).tokens)

    def num_computed_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_computed

    def token_ids(self, seq_id: SeqId) -> list[int]:
        return self._seq(seq_id).tokens.tolist()

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The interleaved tables (`flat[i * G + g]`: group g's block i; see `hybrid_state`)."""
        return self._resident(seq_id, "read the block table of").interleaved()

    def group_tables(self, seq_id: SeqId) -> list[list[int]]:
        """Each group's table (a copy; null entries are `null_block`)."""
        seq = self._resident(seq_id, "read the block table of")
        return [list(table) for table in seq.tables]

    def num_free_device_blocks(self) -> int:
        return self._device.num_free

    # ------------------------------------------------------------------ pools
    def pressure(self) -> PressureSnapshot:
        """Snapshot of the shared device pool (every group's blocks) and the CPU pool."""
        device = tier_pressure(self._device)
        used_slots = device.used * self._block_size
        null, mask = self._null, self._block_size - 1
        tails = {}
        for seq in self._seqs.values():
            if seq.on_cpu is None:
                for table in seq.tables:
                    if table[-1] != null:
                        tails[table[-1]] = -len(seq.tokens) & mask
        waste = sum(tails.values())
        return PressureSnapshot(
            device=device,
            cpu=tier_pressure(self._cpu),
            block_size=self._block_size,
            token_slots_allocated=used_slots,
            tokens_held=used_slots - waste,
            waste_slots=waste,
            num_sequences=len(self._seqs),
            num_swapped_sequences=sum(s.on_cpu is not None for s in self._seqs.values()),
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            cow_copies=self._cow_copies,
            swap_out_blocks=self._swaps.out_blocks,
            swap_in_blocks=self._swaps.in_blocks,
            watermark_blocks=self._watermark,
        )

    def group_usage(self) -> list[GroupUsage]:
        """Each group's used and evictable cached blocks (one pass over the pool)."""
        used, cached = [0] * self._groups, [0] * self._groups
        pool = self._device
        for block, (refs, key) in enumerate(zip(pool.ref_counts, pool.keys, strict=True)):
            if refs:
                used[self._owner[block]] += 1
            elif key is not None:
                cached[self._owner[block]] += 1
        free = pool.num_free - pool.num_free_cached
        return [
            GroupUsage(group, window, used[group], cached[group], free)
            for group, window in enumerate(self._windows)
        ]

    def discard(self, device_blocks: Sequence[int], cpu_blocks: Sequence[int]) -> None:
        """Make blocks whose bytes failed verification unfindable by any group's prefix lookup
        (the caller then frees every sequence holding them); unsealed blocks stay as they are."""
        for pool, blocks in ((self._device, device_blocks), (self._cpu, cpu_blocks)):
            for block in blocks:
                if pool.keys[block] is not None:
                    pool.unseal(block)

    # ------------------------------------------------------------------ integrity
    def check_integrity(self, *, verify_hashes: bool = True) -> None:
        """Raise `IntegrityError` if an invariant is broken: reference counts, free queues and
        the hash index of both pools; per sequence, every group's table length, null entries
        only below a sliding group's `first_kept`, no block in two groups, sealed blocks
        indexed under their group's tagged preimage, and writable slots held alone."""
        refs = {"device": [0] * self._device.num_blocks, "cpu": [0] * self._cpu.num_blocks}
        owners: dict[int, int] = {}
        size, null = self._block_size, self._null
        for seq_id, seq in self._seqs.items():
            blocks = -(-len(seq.tokens) // size)
            if not seq.tokens or not 0 <= seq.num_computed <= len(seq.tokens):
                raise IntegrityError(f"sequence {seq_id}: bad token or computed count")
            if len(seq.hashes) * size > seq.num_computed:
                raise IntegrityError(f"sequence {seq_id}: a sealed block is not fully computed")
            if verify_hashes:
                data = tokens_to_bytes(seq.tokens[: len(seq.hashes) * size])
                chain = chain_blocks(
                    seq.hash_seed, data, size, seq.hash_suffix, seq.unsalted_blocks
                )[1]
                if chain != seq.hashes:
                    raise IntegrityError(f"sequence {seq_id}: its hash chain does not recompute")
            for group, table in enumerate(seq.tables):
                self._check_table(seq_id, seq, group, table, blocks, refs, owners)
        check_pool(self._device, refs["device"], verify_hashes=verify_hashes)
        check_pool(self._cpu, refs["cpu"], verify_hashes=verify_hashes)
        for seq_id, seq in self._seqs.items():
            if seq.on_cpu is not None or seq.num_computed == len(seq.tokens):
                continue
            for table in seq.tables:
                for index in range(seq.num_computed // size, len(table)):
                    block = table[index]
                    if block == null or self._device.ref_counts[block] != 1:
                        raise IntegrityError(
                            f"sequence {seq_id}: writable block {block} is shared or null"
                        )
                    if self._device.keys[block] is not None:
                        raise IntegrityError(f"sequence {seq_id}: writable block {block} is sealed")

    def _check_table(
        self,
        seq_id: SeqId,
        seq: HybridSeq,
        group: int,
        table: list[int],
        blocks: int,
        refs: dict[str, list[int]],
        owners: dict[int, int],
    ) -> None:
        window, null, size = self._windows[group], self._null, self._block_size
        if len(table) != blocks:
            raise IntegrityError(f"sequence {seq_id} group {group}: {len(table)} blocks")
        kept = first_kept(window, seq.num_computed, size)
        if seq.dropped[group] > kept:
            raise IntegrityError(f"sequence {seq_id} group {group}: dropped a block it reads")
        tag = group_tag(group)
        for index, block in enumerate(table):
            on_cpu = seq.on_cpu is not None and seq.on_cpu[group][index]
            if block == null and not on_cpu:
                if index >= seq.dropped[group]:
                    raise IntegrityError(
                        f"sequence {seq_id} group {group}: null block {index} inside its window"
                    )
                continue
            if index < seq.dropped[group]:
                raise IntegrityError(f"sequence {seq_id} group {group}: block {index} not null")
            tier = "cpu" if on_cpu else "device"
            if not 0 <= block < len(refs[tier]):
                raise IntegrityError(f"sequence {seq_id}: {tier} block {block} out of range")
            refs[tier][block] += 1
            if tier == "cpu":
                continue
            if owners.setdefault(block, group) != group or self._owner[block] != group:
                raise IntegrityError(f"device block {block} is held by two groups")
            key = self._device.keys[block]
            if index < len(seq.hashes) and key != tag + seq.sealed_key(index, size):
                raise IntegrityError(
                    f"sequence {seq_id} group {group}: sealed block {block} is not indexed "
                    "under its tagged preimage"
                )

    # ------------------------------------------------------------------ swaps
    def _swap_group(self, seq_ids: Sequence[SeqId], *, swapped: bool) -> list[HybridSeq]:
        if isinstance(seq_ids, int) or not seq_ids or len(set(seq_ids)) != len(seq_ids):
            raise InvalidOperation(
                f"a swap group is a non-empty sequence of distinct ids, got {seq_ids!r}"
            )
        group = [self._seq(seq_id) for seq_id in seq_ids]
        for seq_id, seq in zip(seq_ids, group, strict=True):
            if (seq.on_cpu is not None) != swapped:
                state = "already swapped out" if not swapped else "not swapped out"
                raise InvalidOperation(f"sequence {seq_id!r} is {state}")
        return group

    def _group_refs(self, seqs: list[HybridSeq], *, cpu_side: bool) -> dict[int, int]:
        """References the swap group holds to each block of one tier (nulls excluded)."""
        refs: dict[int, int] = {}
        for seq in seqs:
            for group, table in enumerate(seq.tables):
                for index, block in enumerate(table):
                    on_cpu = seq.on_cpu is not None and seq.on_cpu[group][index]
                    if on_cpu == cpu_side and (on_cpu or block != self._null):
                        refs[block] = refs.get(block, 0) + 1
        return refs

    def _moving_out(self, seqs: list[HybridSeq]) -> tuple[dict[int, int], list[int]]:
        refs = self._group_refs(seqs, cpu_side=False)
        device_refs = self._device.ref_counts
        return refs, [block for block, count in refs.items() if device_refs[block] == count]

    def can_swap_out(self, seq_ids: Sequence[SeqId]) -> bool:
        _, moving = self._moving_out(self._swap_group(seq_ids, swapped=False))
        return len(moving) <= self._cpu.num_free

    def swap_out(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int]]:
        """Move the group's blocks nobody else holds to the CPU; returns (device, cpu) pairs.
        Blocks other sequences hold stay on the device; null entries stay null."""
        seqs = self._swap_group(seq_ids, swapped=False)
        refs, moving = self._moving_out(seqs)
        if len(moving) > self._cpu.num_free:
            raise NoFreeBlocks(
                "cannot swap out the group",
                needed=len(moving),
                available=self._cpu.num_free,
                tier="cpu",
            )
        mapping: dict[int, int] = {}
        for block in moving:
            cpu_block = self._cpu.pop_free()
            self._cpu.ref_counts[cpu_block] = refs[block]
            mapping[block] = cpu_block
        for seq in seqs:
            seq.on_cpu = [[block in mapping for block in table] for table in seq.tables]
            seq.tables = [[mapping.get(block, block) for block in table] for table in seq.tables]
            seq.synced = 0
        for block in reversed(moving):
            self._device.release(block, refs[block])
        self._swaps.out_blocks += len(mapping)
        return list(mapping.items())

    def _swap_in_plan(self, seqs: list[HybridSeq]) -> tuple[dict[int, int], dict, int]:
        """(group refs per CPU block, each CPU block's (group, tagged key or None), blocks
        needed): a sealed block still cached on the device is shared, not copied."""
        refs = self._group_refs(seqs, cpu_side=True)
        sealed: dict[int, tuple[int, bytes | None]] = {}
        for seq in seqs:
            assert seq.on_cpu is not None
            for group, table in enumerate(seq.tables):
                for index, block in enumerate(table):
                    if seq.on_cpu[group][index] and block not in sealed:
                        key = None
                        if self._caching and index < len(seq.hashes):
                            key = group_tag(group) + seq.sealed_key(index, self._block_size)
                        sealed[block] = (group, key)
        cached, device_refs = self._device.cached, self._device.ref_counts
        needed, seen = 0, set()
        for _, key in sealed.values():
            holder = cached.get(key) if key is not None else None
            if holder is not None and device_refs[holder] > 0:
                continue
            if key is None or key not in seen:
                needed += 1
            if key is not None:
                seen.add(key)
        return refs, sealed, needed

    def can_swap_in(self, seq_ids: Sequence[SeqId]) -> bool:
        _, _, needed = self._swap_in_plan(self._swap_group(seq_ids, swapped=True))
        return needed <= self._device.num_free - self._watermark

    def swap_in(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int]]:
        """Bring the group's CPU blocks back; returns (cpu, device) copy pairs."""
        seqs = self._swap_group(seq_ids, swapped=True)
        refs, sealed, needed = self._swap_in_plan(seqs)
        device = self._device
        device.require_free(needed, self._watermark, "cannot swap in the group")
        mapping: dict[int, int] = {}
        for cpu_block, (_, key) in sealed.items():  # hits first: no pop may evict them
            holder = device.cached.get(key) if key is not None else None
            if holder is not None:
                device.acquire(holder, refs[cpu_block])
                mapping[cpu_block] = holder
        pairs = []
        for cpu_block, (group, key) in sealed.items():
            if cpu_block in mapping:
                continue
            holder = device.cached.get(key) if key is not None else None
            if holder is not None:  # copied in by this swap-in from another CPU block
                device.acquire(holder, refs[cpu_block])
                mapping[cpu_block] = holder
                continue
            block = device.pop_free()
            device.ref_counts[block] = refs[cpu_block]
            self._owner[block] = group
            if key is not None:
                device.seal(block, key, hashlib.sha256(key).digest())
            mapping[cpu_block] = block
            pairs.append((cpu_block, block))
        for seq in seqs:
            assert seq.on_cpu is not None
            seq.tables = [
                [mapping[b] if cpu else b for b, cpu in zip(table, on_cpu, strict=True)]
                for table, on_cpu in zip(seq.tables, seq.on_cpu, strict=True)
            ]
            seq.on_cpu = None
        for cpu_block in reversed(refs):
            self._cpu.release(cpu_block, refs[cpu_block])
        self._swaps.in_blocks += len(pairs)
        return pairs
