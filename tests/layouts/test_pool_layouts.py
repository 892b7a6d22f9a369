"""A rank's pool layout: chosen from `kv_layout`, it allocates, addresses and decommits the
device pool the way the engine's manager of that layout plans it."""

from __future__ import annotations

import pytest
import torch

from kv_layouts.pools import ContiguousPool, PagedPool, VirtualPool, pool_layout_for
from kv_layouts.virtual_pool import virtual_geometry
from pagedserve_kernels import allocate_kv_pool
from workers.config import WorkerConfig
from workers.kv_memory import KVShape
from workers.plan import StepPlan

SHAPE = KVShape(num_layers=2, block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.float32)
MAX_LEN = 1024


def _allocate(blocks: int, device: torch.device) -> torch.Tensor:
    return allocate_kv_pool(
        num_layers=SHAPE.num_layers,
        num_blocks=blocks,
        block_size=SHAPE.block_size,
        num_kv_heads=SHAPE.num_kv_heads,
        head_dim=SHAPE.head_dim,
        dtype=SHAPE.dtype,
        device=device,
    )


def _layout(kv_layout: str) -> PagedPool | VirtualPool:
    config = WorkerConfig(kv_layout=kv_layout, kv_virtual_slots=2, block_size=SHAPE.block_size)
    layout = pool_layout_for(config, SHAPE, MAX_LEN)
    assert isinstance(layout, PagedPool | VirtualPool)
    return layout


def test_each_setting_gets_its_layout_and_addressing() -> None:
    paged, contiguous, virtual = _layout("paged"), _layout("contiguous"), _layout("virtual")
    assert type(paged) is PagedPool and not paged.contiguous
    assert type(contiguous) is ContiguousPool and contiguous.contiguous
    assert type(virtual) is VirtualPool and virtual.contiguous


@pytest.mark.parametrize("kv_layout", ["paged", "contiguous"])
def test_dense_pools_hold_the_budget_and_refuse_decommits(kv_layout: str) -> None:
    layout = _layout(kv_layout)
    pool = layout.allocate(7, torch.device("cpu"), _allocate)
    assert pool.shape[2] == 7
    assert layout.resident_bytes() is None
    layout.decommit(StepPlan(step_id=3))  # nothing to decommit: accepted
    with pytest.raises(
        ValueError, match=f"step 3: decommit ranges sent but kv_layout is '{kv_layout}'"
    ):
        layout.decommit(StepPlan(step_id=3, decommit=[(0, 1)]))


def test_virtual_pool_reserves_every_slot_and_decommits_to_zero() -> None:
    layout = _layout("virtual")
    assert layout.resident_bytes() is None
    pool = layout.allocate(7, torch.device("cpu"), _allocate)
    element = torch.empty((), dtype=SHAPE.dtype).element_size()
    geometry = virtual_geometry(
        2,
        MAX_LEN,
        SHAPE.block_size,
        SHAPE.block_size * SHAPE.num_kv_heads * SHAPE.head_dim * element,
    )
    assert pool.shape[2] == geometry.num_blocks  # the reservation, not the physical budget
    empty = layout.resident_bytes()
    assert empty is not None
    pool[:, :, : geometry.slot_blocks] = 1.0
    written = layout.resident_bytes()
    assert written is not None and written > empty
    layout.decommit(StepPlan(step_id=1, decommit=[(0, geometry.slot_blocks)]))
    after = layout.resident_bytes()
    assert after is not None and after < written
    assert torch.count_nonzero(pool[:, :, : geometry.slot_blocks]) == 0


def test_virtual_pool_refuses_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        _layout("virtual").allocate(7, torch.device("cuda", 0), _allocate)
