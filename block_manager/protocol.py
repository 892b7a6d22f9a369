"""`KVManager`: the one contract the scheduler and the engine code against.

It is only the calls they make on every layout; nothing outside `kv_layouts` asks which layout
it holds. What only some managers have is an optional piece, looked up once when the engine is
built (`cache_tier_of`, `block_events_of`), never per call:

- `truncate` drops uncomputed tokens (a speculative step's rejected drafts) and any blocks only
  they used;
- `take_table_delta` reports what changed in a sequence's block table since the workers were
  last told, so the scheduler never copies or diffs whole tables;
- `CacheTier`: the CPU cache tier's copies (`take_transfers` / `complete_transfers` hand the
  step's demotions and promotions to the workers and unpin them once run), its promotion
  policy and its counters;
- `BlockEventSource`: what a cluster-wide prefix index learns of the cache (seals and
  evictions, and a full scan for resyncs).

A layout's memory accounting (`usage`) is outside it: the layouts benchmark reads it through
`block_manager.usage.LayoutAccounting`. How a layout sizes, places and returns memory is its own
(`kv_layouts`): the step plans and the model carry nothing of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from block_manager.cache_key import CacheKey
from block_manager.errors import Tier
from block_manager.events import BlockEvent
from block_manager.pressure import PressureSnapshot
from block_manager.tiers import TierCounters, TierTransfers
from block_manager.types import BlockCopy, SeqId

TableDelta = tuple[int, list[int]]
"""(table_start, new_blocks): the workers keep their first `table_start` entries of the
sequence's table and append `new_blocks`; the result equals `block_table(seq_id)`."""


@runtime_checkable
class KVManager(Protocol):
    """What the scheduler and engine call on a KV manager, and nothing else (see the module
    docstring); a manager's other views (its token ids, slot mappings, cached hashes) are its
    own.

    `fork` and swapping may refuse (`InvalidOperation`) in a layout that has neither: its
    `kv_layouts.KVLayout` says so once, and admission and preemption never ask it then.

    Invariants every implementation keeps: a mutation either succeeds whole or raises with
    nothing changed; `block_table(s)` holds `ceil(num_tokens(s) / block_size)` device block ids;
    applying every `take_table_delta(s)` in order to a table reset at `allocate`, `fork`, `free`
    and `swap_out` of `s` gives `block_table(s)`.
    """

    @property
    def block_size(self) -> int: ...
    @property
    def num_device_blocks(self) -> int: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def watermark_blocks(self) -> int: ...

    # queries
    def has_sequence(self, seq_id: SeqId) -> bool: ...
    def is_swapped(self, seq_id: SeqId) -> bool: ...
    def num_tokens(self, seq_id: SeqId) -> int: ...
    def num_computed_tokens(self, seq_id: SeqId) -> int: ...
    def block_table(self, seq_id: SeqId) -> list[int]: ...
    def num_free_device_blocks(self) -> int: ...
    def blocks_needed_to_allocate(self, token_ids: Sequence[int], key: CacheKey) -> int: ...
    def can_append(self, seq_ids: Sequence[SeqId]) -> bool: ...
    def can_swap_out(self, seq_ids: Sequence[SeqId]) -> bool: ...
    def can_swap_in(self, seq_ids: Sequence[SeqId]) -> bool: ...
    def pressure(self) -> PressureSnapshot: ...
    def check_integrity(self, *, verify_hashes: bool = True) -> None: ...

    # mutations
    def allocate(self, seq_id: SeqId, token_ids: Sequence[int], key: CacheKey) -> int: ...
    def append_token(self, seq_id: SeqId, token_id: int) -> BlockCopy | None: ...
    def mark_computed(self, seq_id: SeqId, num_computed_tokens: int) -> None: ...
    def truncate(self, seq_id: SeqId, num_tokens: int) -> None: ...
    def replace_token(self, seq_id: SeqId, position: int, token_id: int) -> None: ...
    def fork(self, parent_id: SeqId, child_id: SeqId) -> None: ...
    def free(self, seq_id: SeqId) -> None: ...
    def swap_out(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int]]: ...
    def swap_in(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int]]: ...
    def take_table_delta(self, seq_id: SeqId) -> TableDelta: ...
    def discard(self, device_blocks: Sequence[int], cpu_blocks: Sequence[int]) -> None:
        """Makes blocks whose content is wrong (a swap-in that failed its checksum) unfindable
        by any later prefix lookup."""
        ...


@runtime_checkable
class CacheTier(Protocol):
    """A manager whose CPU pool is also a cache tier: evicted prefix blocks are demoted to it and
    promoted back on a hit. The scheduler asks `cache_tier_of` once and drives it every step."""

    @property
    def cpu_cache(self) -> bool: ...
    def set_promotion(self, enabled: bool) -> None: ...
    def take_transfers(self, step_id: int = 0) -> TierTransfers: ...
    def complete_transfers(self, step_id: int | None = None) -> None: ...
    def tier_counters(self) -> TierCounters: ...


@runtime_checkable
class BlockEventSource(Protocol):
    """A manager that seals blocks under hashes a cluster-wide prefix index can follow."""

    def take_events(self) -> list[BlockEvent]: ...
    def cached_hashes_by_tier(self) -> dict[Tier, list[bytes]]: ...


def cache_tier_of(manager: KVManager) -> CacheTier | None:
    """`manager`'s CPU cache tier, or None for a layout without one (asked once, at build)."""
    return manager if isinstance(manager, CacheTier) else None


def block_events_of(manager: KVManager) -> BlockEventSource | None:
    """`manager`'s block events, or None for a layout that seals nothing (asked once, at
    build)."""
    return manager if isinstance(manager, BlockEventSource) else None
