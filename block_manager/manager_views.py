"""`CacheViews`: what `KVCacheManager` shows of its pools without changing a table, and the
hooks of its CPU cache tier.

A mixin over the manager's own state (`_device`, `_cpu`, `_tables`, counters and the optional
`CpuTier`), so the manager's module keeps its mutations and this one its read-only views:
sizes, sequence lookups (`num_tokens`, `block_table`, ...), `pressure`, `usage`, the findable
hashes (`cached_block_hashes`, `cached_hashes_by_tier`), the `BlockEvent` stream
(`take_events`), `check_integrity`, and the tier's transfer hooks. Nothing here allocates,
frees or seals a block (except `discard`, which only makes bad blocks unfindable).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from block_manager.errors import InvalidOperation, Tier
from block_manager.events import BlockEvent
from block_manager.integrity import check_manager_integrity
from block_manager.pool import BlockPool
from block_manager.pressure import PressureSnapshot, tier_pressure, waste_slots
from block_manager.swap import SwapCounters
from block_manager.table import BlockTable
from block_manager.tiers import CpuTier, TierCounters, TierTransfers
from block_manager.transfer_leases import TransferLeases
from block_manager.types import SeqId
from block_manager.usage import LayoutUsage
from block_manager.validation import unknown_sequence


class CacheViews:
    """Read-only views and tier hooks of a paged manager (see the module doc)."""

    __slots__ = ()

    _block_size: int
    _caching: bool
    _watermark: int
    _device: BlockPool
    _cpu: BlockPool
    _tables: dict[SeqId, BlockTable]
    _prefix_query_tokens: int
    _prefix_hit_tokens: int
    _cow_copies: int
    _swaps: SwapCounters
    _tier: CpuTier | None
    _leases: TransferLeases

    # ------------------------------------------------------------------ attributes
    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_device_blocks(self) -> int:
        return self._device.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self._cpu.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self._caching

    @property
    def watermark_blocks(self) -> int:
        return self._watermark

    # ------------------------------------------------------------------ lookups
    def _table(self, seq_id: SeqId) -> BlockTable:
        table = self._tables.get(seq_id)
        if table is None:
            raise unknown_sequence(seq_id)
        return table

    def _not_resident(self, seq_id: SeqId, action: str) -> InvalidOperation:
        """The error for a sequence that is unknown or swapped out (hot paths raise it)."""
        if seq_id not in self._tables:
            return unknown_sequence(seq_id)
        return InvalidOperation(f"cannot {action} sequence {seq_id!r}: it is swapped out")

    def _resident(self, seq_id: SeqId, action: str) -> BlockTable:
        table = self._tables.get(seq_id)
        if table is None or table.on_cpu is not None:
            raise self._not_resident(seq_id, action)
        return table

    # ------------------------------------------------------------------ queries
    def has_sequence(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    def is_swapped(self, seq_id: SeqId) -> bool:
        return self._table(seq_id).on_cpu is not None

    def num_tokens(self, seq_id: SeqId) -> int:
        table = self._tables.get(seq_id)
        if table is None:
            raise unknown_sequence(seq_id)
        return len(table.tokens)

    def num_computed_tokens(self, seq_id: SeqId) -> int:
        return self._table(seq_id).num_computed

    def token_ids(self, seq_id: SeqId) -> list[int]:
        """The sequence's tokens (prompt and appended), in order."""
        return self._table(seq_id).tokens.tolist()

    def block_table(self, seq_id: SeqId) -> list[int]:
        """Device block ids in logical order (a copy; the sequence must be device-resident)."""
        table = self._tables.get(seq_id)
        if table is None or table.on_cpu is not None:
            raise self._not_resident(seq_id, "read the block table of")
        return table.block_ids.copy()

    def num_free_device_blocks(self) -> int:
        """Blocks an allocation could take now: free plus evictable cached."""
        return self._device.num_free

    # ------------------------------------------------------------------ pools and the cache
    def pressure(self) -> PressureSnapshot:
        """Snapshot of both tiers and the cumulative counters."""
        device = tier_pressure(self._device)
        used_slots = device.used * self._block_size
        waste = waste_slots(self._tables.values(), self._block_size)
        return PressureSnapshot(
            device=device,
            cpu=tier_pressure(self._cpu),
            block_size=self._block_size,
            token_slots_allocated=used_slots,
            tokens_held=used_slots - waste,
            waste_slots=waste,
            num_sequences=len(self._tables),
            num_swapped_sequences=sum(t.on_cpu is not None for t in self._tables.values()),
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            cow_copies=self._cow_copies,
            swap_out_blocks=self._swaps.out_blocks,
            swap_in_blocks=self._swaps.in_blocks,
            watermark_blocks=self._watermark,
        )

    def usage(self) -> LayoutUsage:
        """The paged layout in `LayoutUsage` terms: blocks held by sequences are reserved and
        backed alike; the unfilled part of partial tails is its only (internal) waste."""
        used_slots = (self._device.num_blocks - self._device.num_free) * self._block_size
        waste = waste_slots(self._tables.values(), self._block_size)
        return LayoutUsage(
            reserved_slots=used_slots,
            backed_slots=used_slots,
            live_slots=used_slots - waste,
            internal_fragmentation_slots=waste,
            reservation_waste_slots=0,
            pool_slots=self._device.num_blocks * self._block_size,
        )

    def cached_block_hashes(self) -> Iterator[bytes]:
        """Chain hashes of the sealed device blocks a prefix lookup can hit now: the referenced
        ones first (block id order), then the evictable ones, those evicted last first (so a
        bounded reader keeps the longest-lived). Lazy: consume it before the next mutation."""
        pool = self._device
        refs, hashes = pool.ref_counts, pool.hashes
        for block, digest in enumerate(hashes):
            if digest is not None and refs[block] > 0:
                yield digest
        for block in reversed(pool.free_queue()):
            digest = hashes[block]
            if digest is None:  # unsealed free blocks all sit before the cached ones
                return
            yield digest

    def cached_hashes_by_tier(self) -> dict[Tier, list[bytes]]:
        """Every hash a prefix lookup can hit now, per tier (a full scan: for resyncs only)."""
        return {
            pool.tier: [digest for digest in pool.hashes if digest is not None]
            for pool in (self._device, self._cpu)
        }

    def take_events(self) -> list[BlockEvent]:
        """The seals and evictions since the last call, in order ([] unless `record_events`)."""
        events = self._device.events
        if not events:
            return []
        self._device.events = self._cpu.events = []
        return events

    def check_integrity(self, *, verify_hashes: bool = True) -> None:
        """Raise `IntegrityError` if any invariant is broken (see `block_manager.integrity`)."""
        tier = self._tier
        check_manager_integrity(
            device=self._device,
            cpu=self._cpu,
            tables=self._tables,
            block_size=self._block_size,
            caching=self._caching,
            verify_hashes=verify_hashes,
            pinned=tier.pinned_refs() if tier is not None else None,
            lease_pins=self._leases.pinned_refs(),
        )

    @property
    def transfer_leases(self) -> TransferLeases:
        """Pins of blocks moving to or from another replica (`block_manager.transfer_leases`)."""
        return self._leases

    # ------------------------------------------------------------------ the CPU cache tier
    @property
    def cpu_cache(self) -> bool:
        """Whether the CPU pool is a cache tier (`block_manager.tiers`)."""
        return self._tier is not None

    def set_promotion(self, enabled: bool) -> None:
        """Whether CPU-tier hits are promoted (the caller's cost model decides) or missed."""
        if self._tier is not None:
            self._tier.promote = enabled

    def take_transfers(self, step_id: int = 0) -> TierTransfers:
        """The tier copies planned since the last call, for step `step_id`: demotions, which the
        workers run before anything else in the step, and promotions, run with the swap-ins."""
        return self._tier.take(step_id) if self._tier is not None else TierTransfers()

    def complete_transfers(self, step_id: int | None = None) -> None:
        """The workers ran step `step_id` and those before it (None: every step taken): unpin
        the blocks their copies read or wrote; a later step's pins stay."""
        if self._tier is not None:
            self._tier.complete(step_id)

    def tier_counters(self) -> TierCounters:
        """Hits by tier, demotions, promotions, refusals (zeros while the tier is off)."""
        if self._tier is None:
            return TierCounters(device_hit_tokens=self._prefix_hit_tokens)
        return TierCounters(**vars(self._tier.counters))

    def discard(self, device_blocks: Sequence[int], cpu_blocks: Sequence[int]) -> None:
        """Make blocks whose bytes failed verification unfindable (the caller then frees every
        sequence holding them); unsealed blocks are left as they are."""
        device, cpu = self._device, self._cpu
        if self._tier is not None:
            self._tier.discard(list(device_blocks), list(cpu_blocks))
            return
        for block in device_blocks:
            if device.keys[block] is not None:
                device.unseal(block)
        for block in cpu_blocks:
            if cpu.keys[block] is not None:
                cpu.unseal(block)
