"""Shared bookkeeping of the non-paged KV layouts: one contiguous run of block ids per sequence.

`RangeKVManager` implements the `KVManager` protocol (`block_manager.protocol`), and none of its
optional pieces (no CPU cache tier, no block events), for layouts where
a sequence's KV lives in ONE contiguous run of block ids `[first, first + reserved)`. Subclasses
decide where the run comes from and what counts as "full" (`_admit`, `_grow`, `_release`,
`_device_used_blocks`, `_backed_blocks`).

What these layouts do not do, by design of the layouts they model: no prefix sharing (every
sequence owns its range alone), no parallel-sampling fork (n > 1), no CPU swap tier (preemption
is by recompute). Each refusal raises `InvalidOperation` naming the layout, and the layout says
so up front (`RangeLayout`: `can_fork`, `has_swap_tier`, `shares_prefixes` False; `validate`
refuses the settings that would need them). The `CacheKey` argument is accepted for the common
interface and unused: nothing is ever found cached. A sequence's most tokens come from the
engine's `SequenceBounds` (its request's prompt + max_tokens).

Invariants (checked by `check_integrity`): ranges of live sequences never overlap; a sequence's
tokens fit its reserved range; the layout's used-block count never exceeds its pool.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from block_manager.cache_key import CacheKey
from block_manager.errors import IntegrityError, InvalidOperation
from block_manager.pressure import PressureSnapshot, TierPressure
from block_manager.protocol import TableDelta
from block_manager.types import BlockCopy, SeqId
from block_manager.usage import LayoutUsage
from block_manager.validation import check_count
from kv_layouts.layout import SequenceBounds

if TYPE_CHECKING:
    from cluster.engine.config import EngineConfig


@dataclass
class SequenceRange:
    """A live sequence: its run `[first, first + reserved_blocks)` and its tokens.

    `synced`: blocks of its table the workers were told (the run never moves, so only appended
    blocks are ever new to them).
    """

    first: int
    reserved_blocks: int
    tokens: list[int]
    num_computed: int = 0
    synced: int = 0


class RangeLayout:
    """What the contiguous and virtual layouts share as `KVLayout`s: one run per sequence, so no
    forks, no swap tier and no prefix sharing, and the model's dtype for the KV."""

    name = "range"
    can_fork = False
    shares_prefixes = False
    groups_layers = False
    has_swap_tier = False

    def validate(self, config: EngineConfig) -> None:
        if config.cache.kv_cache_dtype != "auto":
            raise ValueError(
                f"cache.kv_cache_dtype {config.cache.kv_cache_dtype!r} needs cache.kv_layout "
                f"'paged' (the {self.name!r} layout keeps the model's dtype)"
            )
        if config.scheduler.preemption_mode == "swap":
            raise ValueError(
                f"cache.kv_layout {self.name!r} has no CPU swap tier: set "
                "scheduler.preemption_mode to 'recompute' or 'auto'"
            )


class RangeKVManager(ABC):
    """Base of the contiguous and virtual layouts' managers (see the module docstring)."""

    name = "range"

    def __init__(
        self,
        *,
        num_device_blocks: int,
        block_size: int,
        max_model_len: int,
        watermark_blocks: int = 0,
        bounds: SequenceBounds | None = None,
    ) -> None:
        """`bounds`: each sequence's most tokens (None: every sequence may reach the model's
        context, `max_model_len`)."""
        check_count("num_device_blocks", num_device_blocks, minimum=1)
        check_count("block_size", block_size, minimum=1)
        check_count("max_model_len", max_model_len, minimum=1)
        check_count("watermark_blocks", watermark_blocks, minimum=0)
        if watermark_blocks >= num_device_blocks:
            raise InvalidOperation(
                f"watermark_blocks ({watermark_blocks}) must be < num_device_blocks "
                f"({num_device_blocks})"
            )
        self._num_blocks = num_device_blocks
        self._block_size = block_size
        self._max_model_len = max_model_len
        self._watermark = watermark_blocks
        self._seqs: dict[SeqId, SequenceRange] = {}
        self._bounds = bounds

    # ------------------------------------------------------------------ attributes
    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_device_blocks(self) -> int:
        """The layout's physical budget in blocks (what "full" is measured against)."""
        return self._num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return 0

    @property
    def enable_prefix_caching(self) -> bool:
        return False

    @property
    def watermark_blocks(self) -> int:
        return self._watermark

    # ------------------------------------------------------------------ reservations
    def _reservation_blocks(self, seq_id: SeqId, num_tokens: int) -> int:
        bound = None if self._bounds is None else self._bounds.max_tokens(seq_id)
        limit = self._max_model_len if bound is None else min(bound, self._max_model_len)
        limit = max(limit, num_tokens + 1)
        return -(-limit // self._block_size)

    def _range_blocks(self, seq_id: SeqId, num_tokens: int) -> int:
        """Blocks of the range `allocate` takes for the sequence (its max-length reservation)."""
        return self._reservation_blocks(seq_id, num_tokens)

    # ------------------------------------------------------------------ queries
    def _seq(self, seq_id: SeqId) -> SequenceRange:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise InvalidOperation(f"unknown sequence {seq_id!r}")
        return seq

    def has_sequence(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: SeqId) -> bool:
        self._seq(seq_id)
        return False

    def num_tokens(self, seq_id: SeqId) -> int:
        return len(self._seq(seq_id).tokens)

    def num_computed_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_computed

    def token_ids(self, seq_id: SeqId) -> list[int]:
        return list(self._seq(seq_id).tokens)

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The blocks holding the sequence's tokens: a contiguous run starting at its range."""
        seq = self._seq(seq_id)
        used = -(-len(seq.tokens) // self._block_size)
        return list(range(seq.first, seq.first + used))

    def take_table_delta(self, seq_id: SeqId) -> TableDelta:
        """Blocks appended since the last call (the run never moves, so nothing is replaced)."""
        seq = self._seq(seq_id)
        used = -(-len(seq.tokens) // self._block_size)
        start = seq.synced
        seq.synced = used
        return start, list(range(seq.first + start, seq.first + used))

    def range_of(self, seq_id: SeqId) -> tuple[int, int]:
        """`[first, end)` block ids of the sequence's whole reserved range."""
        seq = self._seq(seq_id)
        return seq.first, seq.first + seq.reserved_blocks

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        seq = self._seq(seq_id)
        if not 0 <= start <= end <= len(seq.tokens):
            raise InvalidOperation(
                f"slot range [{start}, {end}) is outside sequence {seq_id!r} "
                f"of {len(seq.tokens)} tokens"
            )
        base = seq.first * self._block_size
        return list(range(base + start, base + end))

    def num_free_device_blocks(self) -> int:
        return self._num_blocks - self._device_used_blocks()

    def cached_block_hashes(self) -> Iterator[bytes]:
        """No block is ever sealed for reuse in a reserved-range layout: nothing to publish."""
        return iter(())

    def blocks_needed_to_allocate(self, token_ids: Sequence[int], key: CacheKey) -> int:
        """Blocks `allocate` would charge against the budget (no prefix is ever cached)."""
        return self._admission_cost(None, len(token_ids))

    def cached_prefix_tokens(self, token_ids: Sequence[int], key: CacheKey) -> int:
        return 0

    def can_allocate(self, token_ids: Sequence[int], key: CacheKey) -> bool:
        return self._can_admit(None, len(token_ids))

    def can_append(self, seq_ids: Sequence[SeqId]) -> bool:
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidOperation(f"duplicate sequence ids in {list(seq_ids)!r}")
        return self._can_grow([self._seq(s) for s in seq_ids])

    def can_swap_out(self, seq_ids: Sequence[SeqId]) -> bool:
        return False

    def can_swap_in(self, seq_ids: Sequence[SeqId]) -> bool:
        return False

    # ------------------------------------------------------------------ mutations
    def allocate(self, seq_id: SeqId, token_ids: Sequence[int], key: CacheKey) -> int:
        """Reserve the sequence's range (raises NoFreeBlocks / NeverFits); returns 0 cached."""
        if seq_id in self._seqs:
            raise InvalidOperation(f"sequence {seq_id!r} already exists")
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise InvalidOperation("cannot allocate an empty sequence (no tokens)")
        reserved = self._range_blocks(seq_id, len(tokens))
        first = self._admit(seq_id, reserved, len(tokens))
        self._seqs[seq_id] = SequenceRange(first, reserved, tokens)
        return 0

    def append_token(self, seq_id: SeqId, token_id: int) -> BlockCopy | None:
        seq = self._seq(seq_id)
        self._grow(seq_id, seq)
        seq.tokens.append(int(token_id))
        return None

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Drop the uncomputed tokens past `num_tokens` (rejected speculative tokens); the
        sequence keeps its run, so the next appends land where the dropped tokens were."""
        seq = self._seq(seq_id)
        if type(num_tokens) is not int or not (
            max(seq.num_computed, 1) <= num_tokens <= len(seq.tokens)
        ):
            raise InvalidOperation(
                f"cannot truncate sequence {seq_id!r} to {num_tokens!r} tokens: it must keep "
                f"its {seq.num_computed} computed tokens and at least one, and it has "
                f"{len(seq.tokens)}"
            )
        del seq.tokens[num_tokens:]

    def replace_token(self, seq_id: SeqId, position: int, token_id: int) -> None:
        """Sets the id of the uncomputed token at `position` (a placeholder appended for a
        token still being sampled); the run and its slots are untouched."""
        seq = self._seq(seq_id)
        if type(position) is not int or not seq.num_computed <= position < len(seq.tokens):
            raise InvalidOperation(
                f"cannot replace token {position!r} of sequence {seq_id!r}: only its uncomputed "
                f"tokens [{seq.num_computed}, {len(seq.tokens)}) can be replaced"
            )
        if type(token_id) is not int or not 0 <= token_id < 2**32:
            raise InvalidOperation(f"token id must be an integer in [0, 2**32), got {token_id!r}")
        seq.tokens[position] = token_id

    def mark_computed(self, seq_id: SeqId, num_computed_tokens: int) -> None:
        seq = self._seq(seq_id)
        if not seq.num_computed <= num_computed_tokens <= len(seq.tokens):
            raise InvalidOperation(
                f"num_computed_tokens {num_computed_tokens!r} for sequence {seq_id!r} must be in "
                f"[{seq.num_computed}, {len(seq.tokens)}]"
            )
        seq.num_computed = num_computed_tokens

    def free(self, seq_id: SeqId) -> None:
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        self._release(seq)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        raise InvalidOperation(
            f"the {self.name} KV layout does not share memory between sequences: parallel "
            "sampling (n > 1) needs cache.kv_layout 'paged'"
        )

    def swap_out(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int]]:
        raise InvalidOperation(f"the {self.name} KV layout has no CPU swap tier")

    def swap_in(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int]]:
        raise InvalidOperation(f"the {self.name} KV layout has no CPU swap tier")

    def discard(self, device_blocks: Sequence[int], cpu_blocks: Sequence[int]) -> None:
        """Nothing is ever findable by hash here (and nothing is swapped): nothing to drop."""
        return

    # ------------------------------------------------------------------ accounting
    @abstractmethod
    def usage(self) -> LayoutUsage:
        """Reserved, backed and live slots now, with the waste split (see `LayoutUsage`)."""

    def _live_and_covered_slots(self) -> tuple[int, int]:
        """Slots holding tokens, and slots of the blocks those tokens occupy (whole blocks)."""
        size = self._block_size
        live = sum(len(s.tokens) for s in self._seqs.values())
        covered = sum(-(-len(s.tokens) // size) for s in self._seqs.values()) * size
        return live, covered

    def pressure(self) -> PressureSnapshot:
        """The paged snapshot's shape: used = blocks charged to the budget, waste = charged
        slots not holding a token (so `kv_utilization` = live / charged)."""
        used = self._device_used_blocks()
        charged = self._backed_blocks() * self._block_size
        live = sum(len(s.tokens) for s in self._seqs.values())
        none = TierPressure(total=0, free=0, evictable_cached=0, used=0)
        return PressureSnapshot(
            device=TierPressure(
                total=self._num_blocks, free=self._num_blocks - used, evictable_cached=0, used=used
            ),
            cpu=none,
            block_size=self._block_size,
            token_slots_allocated=charged,
            tokens_held=live,
            waste_slots=charged - live,
            num_sequences=len(self._seqs),
            num_swapped_sequences=0,
            prefix_query_tokens=0,
            prefix_hit_tokens=0,
            cow_copies=0,
            swap_out_blocks=0,
            swap_in_blocks=0,
            watermark_blocks=self._watermark,
        )

    def check_integrity(self, *, verify_hashes: bool = True) -> None:
        spans = sorted((s.first, s.first + s.reserved_blocks, k) for k, s in self._seqs.items())
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if start < end:
                raise IntegrityError(f"sequences {a!r} and {b!r} have overlapping KV ranges")
        for seq_id, seq in self._seqs.items():
            if len(seq.tokens) > seq.reserved_blocks * self._block_size:
                raise IntegrityError(f"sequence {seq_id!r} holds more tokens than its range")
        if self._device_used_blocks() > self._num_blocks:
            raise IntegrityError(f"the {self.name} layout uses more blocks than its budget")

    # ------------------------------------------------------------------ layout hooks
    @abstractmethod
    def _admission_cost(self, seq_id: SeqId | None, num_tokens: int) -> int:
        """Blocks charged to the budget when a sequence of `num_tokens` is admitted."""

    @abstractmethod
    def _can_admit(self, seq_id: SeqId | None, num_tokens: int) -> bool:
        """Whether `_admit` would succeed now."""

    @abstractmethod
    def _admit(self, seq_id: SeqId, reserved_blocks: int, num_tokens: int) -> int:
        """Find and take a range; returns its first block. Raises NoFreeBlocks / NeverFits."""

    @abstractmethod
    def _can_grow(self, seqs: list[SequenceRange]) -> bool:
        """Whether one more token for each of `seqs` fits now."""

    @abstractmethod
    def _grow(self, seq_id: SeqId, seq: SequenceRange) -> None:
        """Room for one more token (raises NoFreeBlocks); called before it is appended."""

    @abstractmethod
    def _release(self, seq: SequenceRange) -> None:
        """Give the range of a sequence that was just dropped back to the layout."""

    @abstractmethod
    def _device_used_blocks(self) -> int:
        """Blocks of the budget in use (what "full" is measured against)."""

    @abstractmethod
    def _backed_blocks(self) -> int:
        """Blocks physically committed to live sequences."""
