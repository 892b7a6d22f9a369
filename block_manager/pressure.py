"""Pressure snapshot: the numbers admission, preemption and the metrics exporter decide on."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from block_manager.pool import BlockPool
from block_manager.table import BlockTable


@dataclass(frozen=True)
class TierPressure:
    """Block counts of one tier; ``free + evictable_cached + used == total``.

    ``free`` blocks hold nothing reusable; ``evictable_cached`` blocks are unreferenced but still
    findable by hash (they are reused in LRU order after the free ones); ``used`` are referenced.
    """

    total: int
    free: int
    evictable_cached: int
    used: int

    @property
    def available(self) -> int:
        """Blocks an allocation can take now (free + evictable cached)."""
        return self.free + self.evictable_cached


@dataclass(frozen=True)
class PressureSnapshot:
    """A point-in-time view of both tiers plus cumulative counters since the manager was built.

    ``token_slots_allocated`` = used device blocks x block size; ``tokens_held`` = distinct device
    slots holding a token (a shared block counts once); ``waste_slots`` is their difference (the
    unfilled part of partial tails). Prefix counters are in tokens, swap counters in blocks.
    """

    device: TierPressure
    cpu: TierPressure
    block_size: int
    token_slots_allocated: int
    tokens_held: int
    waste_slots: int
    num_sequences: int
    num_swapped_sequences: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    cow_copies: int
    swap_out_blocks: int
    swap_in_blocks: int
    watermark_blocks: int

    @property
    def kv_utilization(self) -> float:
        """tokens_held / token_slots_allocated (1.0 when nothing is allocated)."""
        if self.token_slots_allocated == 0:
            return 1.0
        return self.tokens_held / self.token_slots_allocated

    @property
    def prefix_hit_rate(self) -> float:
        """prefix_hit_tokens / prefix_query_tokens (0.0 before any query)."""
        if self.prefix_query_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens


def tier_pressure(pool: BlockPool) -> TierPressure:
    """Block counts of one pool."""
    return TierPressure(
        total=pool.num_blocks,
        free=pool.num_free - pool.num_free_cached,
        evictable_cached=pool.num_free_cached,
        used=pool.num_blocks - pool.num_free,
    )


def waste_slots(tables: Iterable[BlockTable], block_size: int) -> int:
    """Unfilled slots of the distinct partial device tails (a shared tail counts once).

    Only a table's last block can be partial, and every holder of a shared partial tail sees the
    same fill (the first write to it is a copy-on-write), so this is exact.
    """
    partial_tails: dict[int, int] = {}
    for table in tables:
        on_cpu = table.on_cpu
        if on_cpu is not None and on_cpu[-1]:
            continue
        block_ids = table.block_ids
        fill = len(table.tokens) - (len(block_ids) - 1) * block_size
        if fill < block_size:
            partial_tails[block_ids[-1]] = fill
    return block_size * len(partial_tails) - sum(partial_tails.values())
