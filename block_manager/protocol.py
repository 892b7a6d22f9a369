"""`KVManager`: the one contract every KV layout's manager satisfies.

The scheduler and the engine code against this protocol only; nothing outside `block_manager`
asks which layout it holds. Layout differences are answered by hooks, not by type checks:

- `layout` names the layout ("paged", "contiguous", "virtual"); `can_fork` says whether
  sequences can share blocks (parallel sampling);
- `reserve` / `forget` give and drop a sequence's maximum length (a range layout sizes its
  reservation from it; the paged layout ignores both);
- `take_decommits` / `has_pending_decommits` hand over memory to return to the OS (only the
  virtual layout has any);
- `truncate` drops uncomputed tokens (a speculative step's rejected drafts) and any blocks only
  they used;
- `take_table_delta` reports what changed in a sequence's block table since the workers were
  last told, so the scheduler never copies or diffs whole tables;
- `take_transfers` / `complete_transfers` hand the step's CPU cache tier copies to the workers
  and unpin them once run; `tier_counters`, `set_promotion` and `discard` complete the tier
  (only the paged layout has one: `NoCacheTier` gives the others empty answers).

A layout's memory accounting (`usage`) is outside it: the layouts benchmark reads it through
`block_manager.usage.LayoutAccounting`, which every manager also satisfies.

`NoDecommits` and `NoReservationHooks` give a manager the do-nothing hooks it has no use for.
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

    Invariants every implementation keeps: a mutation either succeeds whole or raises with
    nothing changed; `block_table(s)` holds `ceil(num_tokens(s) / block_size)` device block ids;
    applying every `take_table_delta(s)` in order to a table reset at `allocate`, `fork`, `free`
    and `swap_out` of `s` gives `block_table(s)`.
    """

    @property
    def layout(self) -> str: ...
    @property
    def can_fork(self) -> bool: ...
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

    # what the cluster-wide index learns of this cache
    def take_events(self) -> list[BlockEvent]: ...
    def cached_hashes_by_tier(self) -> dict[Tier, list[bytes]]: ...

    # the CPU cache tier
    @property
    def cpu_cache(self) -> bool: ...
    def set_promotion(self, enabled: bool) -> None: ...
    def take_transfers(self, step_id: int = 0) -> TierTransfers: ...
    def complete_transfers(self, step_id: int | None = None) -> None: ...
    def tier_counters(self) -> TierCounters: ...
    def discard(self, device_blocks: Sequence[int], cpu_blocks: Sequence[int]) -> None: ...

    # layout hooks
    def reserve(self, seq_id: SeqId, max_total_tokens: int) -> None: ...
    def forget(self, seq_id: SeqId) -> None: ...
    def take_decommits(self) -> list[tuple[int, int]]: ...
    def has_pending_decommits(self) -> bool: ...


class NoDecommits:
    """The decommit hooks of a layout that never hands memory back to the OS."""

    __slots__ = ()

    def take_decommits(self) -> list[tuple[int, int]]:
        """Always empty: nothing is ever decommitted."""
        return []

    def has_pending_decommits(self) -> bool:
        return False


class NoReservationHooks(NoDecommits):
    """The layout hooks of a manager that needs none of them: no reservations, no decommits."""

    __slots__ = ()

    def reserve(self, seq_id: SeqId, max_total_tokens: int) -> None:
        """Nothing to reserve: this layout sizes nothing from a sequence's maximum length."""

    def forget(self, seq_id: SeqId) -> None:
        """Nothing was reserved, so nothing to drop."""


class NoCacheTier:
    """The CPU cache tier hooks of a layout without one: nothing demoted, promoted or pinned."""

    __slots__ = ()

    @property
    def cpu_cache(self) -> bool:
        return False

    def set_promotion(self, enabled: bool) -> None:
        """No tier: nothing to promote."""

    def take_transfers(self, step_id: int = 0) -> TierTransfers:
        return TierTransfers()

    def complete_transfers(self, step_id: int | None = None) -> None:
        """Nothing is ever in flight."""

    def tier_counters(self) -> TierCounters:
        return TierCounters()

    def discard(self, device_blocks: Sequence[int], cpu_blocks: Sequence[int]) -> None:
        """Nothing is sealed by hash in a layout without prefix caching."""
