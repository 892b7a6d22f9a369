"""`KVPoolLayout`: what a rank's device KV pool does differently under each `kv_layout`.

A rank picks one implementation at construction (`pool_layout_for`) and asks it, never the
setting, how to allocate its device pool, how to pack its batch's tables and what to do with a
plan's decommit ranges:

- `PagedPool`: a pool of `num_device_blocks` blocks, tables of any blocks, no decommits;
- `ContiguousPool`: the same pool, but every table is one run of blocks (range attention);
- `VirtualPool`: one virtual slot per sequence (`kv_layouts.virtual_pool`, CPU only) whose
  `num_device_blocks` physical budget the engine's manager enforces; decommits hand pages back.

Invariant: `allocate` is called once before `decommit` or `resident_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kv_layouts.virtual_pool import VirtualKVPool, virtual_geometry
from workers.config import WorkerConfig
from workers.kv_memory import KVShape
from workers.plan import StepPlan

PoolAllocator = Callable[[int, torch.device], torch.Tensor]
"""(num_blocks, device) -> a KV pool tensor of the rank's shape."""


class KVPoolLayout(Protocol):
    """The layout-specific half of a rank's device pool (see the module docstring)."""

    @property
    def contiguous(self) -> bool:
        """Every table is one run of blocks (the batch uses range attention)."""
        ...

    def allocate(
        self, num_device_blocks: int, device: torch.device, allocate_pool: PoolAllocator
    ) -> torch.Tensor: ...

    def decommit(self, plan: StepPlan) -> None:
        """Returns the plan's decommit ranges to the OS; raises ValueError if this layout has
        none to return and the plan sent some."""
        ...

    def resident_bytes(self) -> int | None:
        """Bytes of the pool physically backed, when this layout can measure them."""
        ...

    def release(self) -> None: ...


class PagedPool:
    """A dense pool of blocks addressed through arbitrary block tables."""

    contiguous = False

    def __init__(self, kv_layout: str = "paged") -> None:
        self.kv_layout = kv_layout

    def allocate(
        self, num_device_blocks: int, device: torch.device, allocate_pool: PoolAllocator
    ) -> torch.Tensor:
        return allocate_pool(num_device_blocks, device)

    def decommit(self, plan: StepPlan) -> None:
        if plan.decommit:
            raise ValueError(
                f"step {plan.step_id}: decommit ranges sent but kv_layout is "
                f"{self.kv_layout!r}, not 'virtual'"
            )

    def resident_bytes(self) -> int | None:
        return None

    def release(self) -> None:
        """Nothing beyond the pool tensor the rank drops."""


class ContiguousPool(PagedPool):
    """The paged pool, with every sequence's table one run of blocks."""

    contiguous = True

    def __init__(self) -> None:
        super().__init__("contiguous")


class VirtualPool:
    """One virtual reservation of `kv_virtual_slots` slots of `max_model_len` tokens each, backed
    on first touch and handed back by decommits (CPU only: an anonymous mmap)."""

    contiguous = True

    def __init__(self, config: WorkerConfig, kv_shape: KVShape, max_model_len: int) -> None:
        self.config = config
        self.kv_shape = kv_shape
        self.max_model_len = max_model_len
        self.pool: VirtualKVPool | None = None

    def allocate(
        self, num_device_blocks: int, device: torch.device, allocate_pool: PoolAllocator
    ) -> torch.Tensor:
        if device.type != "cpu":
            raise ValueError(
                "kv_layout 'virtual' is implemented on CPU only (an anonymous mmap); the CUDA "
                "virtual memory management path is not implemented"
            )
        shape = self.kv_shape
        element = torch.empty((), dtype=shape.dtype).element_size()
        geometry = virtual_geometry(
            self.config.kv_virtual_slots,
            self.max_model_len,
            shape.block_size,
            shape.block_size * shape.num_kv_heads * shape.head_dim * element,
        )
        self.pool = VirtualKVPool(
            shape.num_layers,
            geometry.num_blocks,
            shape.block_size,
            shape.num_kv_heads,
            shape.head_dim,
            shape.dtype,
        )
        return self.pool.tensor

    def decommit(self, plan: StepPlan) -> None:
        if plan.decommit:
            assert self.pool is not None, "pool not allocated"
            self.pool.decommit(plan.decommit)

    def resident_bytes(self) -> int | None:
        return None if self.pool is None else self.pool.resident_bytes()

    def release(self) -> None:
        self.pool = None


def pool_layout_for(config: WorkerConfig, kv_shape: KVShape, max_model_len: int) -> KVPoolLayout:
    """The pool layout of `config.kv_layout` (validated by `WorkerConfig`)."""
    if config.kv_layout == "virtual":
        return VirtualPool(config, kv_shape, max_model_len)
    if config.kv_layout == "contiguous":
        return ContiguousPool()
    return PagedPool()
