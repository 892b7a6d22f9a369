"""`DensePool`: the paged and contiguous layouts' device pool on a rank.

A dense tensor of `num_device_blocks` blocks, addressed through the block tables the plans send
(the contiguous layout's tables are single runs, which changes nothing here). It never hands
memory back, so a release is only the rank's registry dropping the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_layouts.layout import PoolAllocator


class DensePool:
    """A dense pool of blocks (see the module docstring)."""

    def allocate(
        self, num_device_blocks: int, device: torch.device, allocate_pool: PoolAllocator
    ) -> torch.Tensor:
        return allocate_pool(num_device_blocks, device)

    def released(self, block_tables: Sequence[Sequence[int]]) -> None:
        """The blocks stay allocated: the engine's manager gives them to the next sequence."""

    @property
    def returned_ranges(self) -> int:
        return 0

    def resident_bytes(self) -> int | None:
        return None

    def release(self) -> None:
        """Nothing beyond the pool tensor the rank drops."""
