"""The `virtual` KV layout: a contiguous virtual range per sequence slot, committed on demand.

The worker's pool is a virtual reservation of `num_slots * slot_blocks` blocks (address space, not
memory). Slot i owns block ids `[i * slot_blocks, (i + 1) * slot_blocks)`, enough for the model
context, so a sequence's KV is always one contiguous run and never moves. Physical memory is
committed as tokens arrive, in units of `commit_blocks` blocks (the blocks spanning one page of the
pool, or more), and released when the sequence ends: the rank's `VirtualPool`
(`kv_layouts.virtual_pool`) sees the release in the next plan and returns the slot's pages to
the OS before its forward pass, from the sequence's block table it holds (no plan field names
them).

"Full" is the physical budget: committed blocks never exceed `num_device_blocks` (the same byte
budget the paged pool gets). A free slot is also needed; slots are `max_num_seqs`, so the
scheduler's own limit binds first.

Geometry (`virtual_geometry`): slot i owns block ids `[i * slot_blocks, (i + 1) * slot_blocks)`;
`commit_blocks` is the fewest blocks whose bytes in one (layer, K/V) plane are a whole number of
pages, and `slot_blocks` is a multiple of it, so every slot and every commit unit starts on a page
boundary in every plane and handing a slot back never touches a neighbour's page.

Invariant: committed == sum over live sequences of their committed blocks; a slot is either free
or owned by exactly one live sequence.
"""

from __future__ import annotations

import heapq
import math
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

from block_manager.errors import InvalidOperation, NeverFits, NoFreeBlocks
from block_manager.types import SeqId
from block_manager.usage import LayoutUsage
from block_manager.validation import check_count
from kv_layouts.layout import KVBudget, KVPool, SequenceBounds
from kv_layouts.ranges import RangeKVManager, RangeLayout, SequenceRange

if TYPE_CHECKING:
    from cluster.engine.config import EngineConfig
    from workers.config import WorkerConfig
    from workers.kv_memory import KVShape

PAGE_BYTES = mmap.PAGESIZE


@dataclass(frozen=True)
class VirtualGeometry:
    """Slot and commit sizes of a virtual pool, in blocks."""

    num_slots: int
    slot_blocks: int
    commit_blocks: int

    @property
    def num_blocks(self) -> int:
        return self.num_slots * self.slot_blocks


def virtual_geometry(
    num_slots: int, max_model_len: int, block_size: int, plane_block_bytes: int
) -> VirtualGeometry:
    """`plane_block_bytes`: bytes of one block in one (layer, K/V) plane of the pool."""
    if min(num_slots, max_model_len, block_size, plane_block_bytes) <= 0:
        raise ValueError(
            f"virtual pool sizes must be positive: num_slots={num_slots}, "
            f"max_model_len={max_model_len}, block_size={block_size}, "
            f"plane_block_bytes={plane_block_bytes}"
        )
    commit = PAGE_BYTES // math.gcd(PAGE_BYTES, plane_block_bytes)
    blocks = -(-max_model_len // block_size)
    return VirtualGeometry(num_slots, -(-blocks // commit) * commit, commit)


class VirtualLayout(RangeLayout):
    """The `virtual` layout: this manager over the rank's `VirtualPool` (one rank, CPU)."""

    name = "virtual"

    def validate(self, config: EngineConfig) -> None:
        super().validate(config)
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError(
                "cache.kv_layout 'virtual' runs on one rank (CPU): "
                "parallel.tensor_parallel_size must be 1"
            )

    def build_manager(self, budget: KVBudget) -> VirtualKVManager:
        geometry = virtual_geometry(
            budget.max_num_seqs, budget.max_model_len, budget.block_size, budget.plane_block_bytes
        )
        return VirtualKVManager(
            num_device_blocks=budget.num_device_blocks,
            block_size=budget.block_size,
            max_model_len=budget.max_model_len,
            num_slots=geometry.num_slots,
            slot_blocks=geometry.slot_blocks,
            commit_blocks=geometry.commit_blocks,
            watermark_blocks=budget.watermark_blocks,
            bounds=budget.bounds,
        )

    def build_pool(self, config: WorkerConfig, kv_shape: KVShape, max_model_len: int) -> KVPool:
        from kv_layouts.virtual_pool import VirtualPool

        return VirtualPool(config, kv_shape, max_model_len)


class VirtualKVManager(RangeKVManager):
    """Per-slot virtual ranges with page-granular commit (see the module docstring)."""

    name = "virtual"

    def __init__(
        self,
        *,
        num_device_blocks: int,
        block_size: int,
        max_model_len: int,
        num_slots: int,
        slot_blocks: int,
        commit_blocks: int = 1,
        watermark_blocks: int = 0,
        bounds: SequenceBounds | None = None,
    ) -> None:
        super().__init__(
            num_device_blocks=num_device_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            watermark_blocks=watermark_blocks,
            bounds=bounds,
        )
        check_count("num_slots", num_slots, minimum=1)
        check_count("commit_blocks", commit_blocks, minimum=1)
        check_count("slot_blocks", slot_blocks, minimum=1)
        if slot_blocks * block_size < max_model_len or slot_blocks % commit_blocks:
            raise InvalidOperation(
                f"slot_blocks ({slot_blocks}) must cover max_model_len ({max_model_len}) in "
                f"blocks of {block_size} and be a multiple of commit_blocks ({commit_blocks})"
            )
        self._num_slots = num_slots
        self._slot_blocks = slot_blocks
        self._unit = commit_blocks
        self._free_slots = list(range(num_slots))
        self._committed = 0

    @property
    def num_virtual_blocks(self) -> int:
        """Blocks of the worker's virtual pool (address space; only committed ones cost memory)."""
        return self._num_slots * self._slot_blocks

    @property
    def commit_blocks(self) -> int:
        return self._unit

    def committed_blocks(self, num_tokens: int) -> int:
        """Blocks committed for a sequence of `num_tokens` tokens (whole commit units)."""
        blocks = -(-num_tokens // self._block_size)
        return -(-blocks // self._unit) * self._unit

    def _admission_cost(self, seq_id: SeqId | None, num_tokens: int) -> int:
        return self.committed_blocks(num_tokens)

    def _can_admit(self, seq_id: SeqId | None, num_tokens: int) -> bool:
        cost = self.committed_blocks(num_tokens)
        room = self._num_blocks - self._watermark - self._committed
        return bool(self._free_slots) and cost <= room

    def _admit(self, seq_id: SeqId, reserved_blocks: int, num_tokens: int) -> int:
        cost = self.committed_blocks(num_tokens)
        budget = self._num_blocks - self._watermark
        if cost > budget or num_tokens > self._slot_blocks * self._block_size:
            raise NeverFits(
                f"sequence {seq_id!r} of {num_tokens} tokens needs {cost} committed blocks; the "
                f"physical budget is {budget} and a slot holds {self._slot_blocks} blocks",
                needed=cost,
                available=budget,
            )
        room = budget - self._committed
        if cost > room or not self._free_slots:
            raise NoFreeBlocks(
                f"cannot admit sequence {seq_id!r}: {len(self._free_slots)} free slots, "
                f"{room} blocks of physical budget left (watermark {self._watermark} kept free)",
                needed=cost,
                available=max(room, 0),
                tier="device",
            )
        slot = heapq.heappop(self._free_slots)
        self._committed += cost
        return slot * self._slot_blocks

    def _range_blocks(self, seq_id: SeqId, num_tokens: int) -> int:
        """The range is the whole slot (the virtual reservation), whatever the request's size."""
        return self._slot_blocks

    def _growth(self, seq: SequenceRange) -> int:
        """Blocks one more token commits (a new unit when the committed ones are full)."""
        held = len(seq.tokens)
        return self.committed_blocks(held + 1) - self.committed_blocks(held)

    def _can_grow(self, seqs: list[SequenceRange]) -> bool:
        capacity = self._slot_blocks * self._block_size
        if any(len(s.tokens) >= capacity for s in seqs):
            return False
        return self._committed + sum(self._growth(s) for s in seqs) <= self._num_blocks

    def _grow(self, seq_id: SeqId, seq: SequenceRange) -> None:
        if not self._can_grow([seq]):
            raise NoFreeBlocks(
                f"no physical memory to commit for the next token of sequence {seq_id!r}",
                needed=self._growth(seq),
                available=self._num_blocks - self._committed,
                tier="device",
            )
        self._committed += self._growth(seq)

    def _release(self, seq: SequenceRange) -> None:
        committed = self.committed_blocks(len(seq.tokens))
        self._committed -= committed
        heapq.heappush(self._free_slots, seq.first // self._slot_blocks)

    def _device_used_blocks(self) -> int:
        return self._committed

    def _backed_blocks(self) -> int:
        return self._committed

    def usage(self) -> LayoutUsage:
        live, _ = self._live_and_covered_slots()
        size = self._block_size
        backed = self._committed * size
        return LayoutUsage(
            reserved_slots=len(self._seqs) * self._slot_blocks * size,
            backed_slots=backed,
            live_slots=live,
            internal_fragmentation_slots=backed - live,
            reservation_waste_slots=0,
            pool_slots=self._num_blocks * size,
        )
