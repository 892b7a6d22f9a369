"""The `contiguous` KV layout: each request reserves its maximum length up front, in one run.

This is how servers reserved KV before paging: at admission a sequence takes a contiguous run of
block ids covering its maximum length (prompt + max_tokens, capped by the model context), chosen
first-fit over the pool, and keeps all of it until it ends. Two wastes follow and are reported
apart: the unused tail of each reservation (reservation waste) and external fragmentation (free
blocks split into runs too short for the next request, which then waits although the free total
would hold it, and although its actual tokens would fit a paged pool).

`ContiguousLayout` is its `KVLayout`: this manager, and the paged layout's dense pool (a run of
blocks is a block table like any other, so the workers and the attention kernels are the same).

Invariant: `_free_runs` is sorted by start, its runs never touch or overlap (neighbours are
merged on release), and free + reserved blocks == the pool.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from block_manager.errors import IntegrityError, NeverFits, NoFreeBlocks
from block_manager.types import SeqId
from block_manager.usage import LayoutUsage
from kv_layouts.layout import KVBudget, KVPool, SequenceBounds
from kv_layouts.ranges import RangeKVManager, RangeLayout, SequenceRange

if TYPE_CHECKING:
    from workers.config import WorkerConfig
    from workers.kv_memory import KVShape


class ContiguousLayout(RangeLayout):
    """The `contiguous` layout (see the module docstring)."""

    name = "contiguous"

    def build_manager(self, budget: KVBudget) -> ContiguousKVManager:
        return ContiguousKVManager(
            num_device_blocks=budget.num_device_blocks,
            block_size=budget.block_size,
            max_model_len=budget.max_model_len,
            watermark_blocks=budget.watermark_blocks,
            bounds=budget.bounds,
        )

    def build_pool(self, config: WorkerConfig, kv_shape: KVShape, max_model_len: int) -> KVPool:
        from kv_layouts.pools import DensePool

        return DensePool()


class ContiguousKVManager(RangeKVManager):
    """Max-length contiguous reservations, first-fit (see the module docstring)."""

    name = "contiguous"

    def __init__(
        self,
        *,
        num_device_blocks: int,
        block_size: int,
        max_model_len: int,
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
        self._free_runs: list[tuple[int, int]] = [(0, num_device_blocks)]
        """(start, length) of each free run, sorted by start."""
        self._reserved = 0

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of the free runs in address order (a copy)."""
        return list(self._free_runs)

    def largest_free_run(self) -> int:
        return max((length for _, length in self._free_runs), default=0)

    def _admission_cost(self, seq_id: SeqId | None, num_tokens: int) -> int:
        if seq_id is None:
            return -(-max(self._max_model_len, num_tokens + 1) // self._block_size)
        return self._reservation_blocks(seq_id, num_tokens)

    def _can_admit(self, seq_id: SeqId | None, num_tokens: int) -> bool:
        needed = self._admission_cost(seq_id, num_tokens)
        free_total = self._num_blocks - self._reserved
        return needed <= self.largest_free_run() and free_total - needed >= self._watermark

    def _admit(self, seq_id: SeqId, reserved_blocks: int, num_tokens: int) -> int:
        if reserved_blocks > self._num_blocks - self._watermark:
            raise NeverFits(
                f"sequence {seq_id!r} reserves {reserved_blocks} blocks for its maximum length "
                f"but the contiguous pool has {self._num_blocks - self._watermark} to give",
                needed=reserved_blocks,
                available=self._num_blocks - self._watermark,
            )
        free_total = self._num_blocks - self._reserved
        if free_total - reserved_blocks < self._watermark:
            raise NoFreeBlocks(
                f"cannot reserve {reserved_blocks} blocks for sequence {seq_id!r} "
                f"(watermark {self._watermark} kept free)",
                needed=reserved_blocks,
                available=max(0, free_total - self._watermark),
                tier="device",
            )
        for index, (start, length) in enumerate(self._free_runs):
            if length >= reserved_blocks:
                if length == reserved_blocks:
                    del self._free_runs[index]
                else:
                    self._free_runs[index] = (start + reserved_blocks, length - reserved_blocks)
                self._reserved += reserved_blocks
                return start
        raise NoFreeBlocks(
            f"no contiguous run of {reserved_blocks} blocks for sequence {seq_id!r}: "
            f"{free_total} blocks are free but the longest run is {self.largest_free_run()} "
            "(external fragmentation)",
            needed=reserved_blocks,
            available=self.largest_free_run(),
            tier="device",
        )

    def _can_grow(self, seqs: list[SequenceRange]) -> bool:
        size = self._block_size
        return all(len(s.tokens) < s.reserved_blocks * size for s in seqs)

    def _grow(self, seq_id: SeqId, seq: SequenceRange) -> None:
        if len(seq.tokens) >= seq.reserved_blocks * self._block_size:
            raise NoFreeBlocks(
                f"sequence {seq_id!r} outgrew its reservation of {seq.reserved_blocks} blocks",
                needed=1,
                available=0,
                tier="device",
            )

    def _release(self, seq: SequenceRange) -> None:
        start, length = seq.first, seq.reserved_blocks
        self._reserved -= length
        runs = self._free_runs
        index = bisect.bisect_left(runs, (start, 0))
        if index < len(runs) and start + length == runs[index][0]:
            length += runs[index][1]
            del runs[index]
        if index > 0 and runs[index - 1][0] + runs[index - 1][1] == start:
            start, length = runs[index - 1][0], runs[index - 1][1] + length
            del runs[index - 1]
            index -= 1
        runs.insert(index, (start, length))

    def _device_used_blocks(self) -> int:
        return self._reserved

    def _backed_blocks(self) -> int:
        return self._reserved

    def usage(self) -> LayoutUsage:
        live, covered = self._live_and_covered_slots()
        reserved = self._reserved * self._block_size
        return LayoutUsage(
            reserved_slots=reserved,
            backed_slots=reserved,
            live_slots=live,
            internal_fragmentation_slots=covered - live,
            reservation_waste_slots=reserved - covered,
            pool_slots=self._num_blocks * self._block_size,
        )

    def check_integrity(self, *, verify_hashes: bool = True) -> None:
        super().check_integrity(verify_hashes=verify_hashes)
        free = sum(length for _, length in self._free_runs)
        if free + self._reserved != self._num_blocks:
            raise IntegrityError(
                f"free runs ({free}) + reserved ({self._reserved}) != pool ({self._num_blocks})"
            )
        for (a, la), (b, _) in zip(self._free_runs, self._free_runs[1:], strict=False):
            if a + la >= b:
                raise IntegrityError(f"free runs at {a} and {b} touch or overlap")
