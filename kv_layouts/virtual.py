"""The `virtual` KV layout: a contiguous virtual range per sequence slot, committed on demand.

The worker's pool is a virtual reservation of `num_slots * slot_blocks` blocks (address space, not
memory). Slot i owns block ids `[i * slot_blocks, (i + 1) * slot_blocks)`, enough for the model
context, so a sequence's KV is always one contiguous run and never moves. Physical memory is
committed as tokens arrive, in units of `commit_blocks` blocks (the blocks spanning one page of the
pool, or more), and released when the sequence ends: the freed range goes into the next plan's
`decommit` list (`take_decommits`), which the worker returns to the OS before its forward pass.

"Full" is the physical budget: committed blocks never exceed `num_device_blocks` (the same byte
budget the paged pool gets). A free slot is also needed; slots are `max_num_seqs`, so the
scheduler's own limit binds first.

Invariant: committed == sum over live sequences of their committed blocks; a slot is either free
or owned by exactly one live sequence.
"""

from __future__ import annotations

import heapq

from block_manager.errors import InvalidOperation, NeverFits, NoFreeBlocks
from block_manager.types import SeqId
from block_manager.usage import LayoutUsage
from block_manager.validation import check_count
from kv_layouts.ranges import RangeKVManager, SequenceRange


class VirtualKVManager(RangeKVManager):
    """Per-slot virtual ranges with page-granular commit (see the module docstring)."""

    layout = "virtual"

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
    ) -> None:
        super().__init__(
            num_device_blocks=num_device_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            watermark_blocks=watermark_blocks,
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
        self._decommits: list[tuple[int, int]] = []

    @property
    def num_virtual_blocks(self) -> int:
        """Blocks of the worker's virtual pool (address space; only committed ones cost memory)."""
        return self._num_slots * self._slot_blocks

    @property
    def commit_blocks(self) -> int:
        return self._unit

    def take_decommits(self) -> list[tuple[int, int]]:
        """`[first, end)` block ranges freed since the last call, for the next plan's decommit."""
        ranges, self._decommits = self._decommits, []
        return ranges

    def has_pending_decommits(self) -> bool:
        return bool(self._decommits)

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
        self._decommits.append((seq.first, seq.first + committed))
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
