"""A rank's KV pool: built by the layout `kv_layout` names, it allocates the device pool the way
that layout's manager plans it and, for the virtual layout, hands a released sequence's slot
back to the OS from the block table the rank holds (no plan field names the memory)."""

from __future__ import annotations

import pytest
import torch

from kv_layouts import KVPool, layout_named
from kv_layouts.pools import DensePool
from kv_layouts.virtual import virtual_geometry
from kv_layouts.virtual_pool import VirtualPool
from pagedserve_kernels import allocate_kv_pool
from workers.config import WorkerConfig
from workers.kv_memory import KVShape

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


def _pool(kv_layout: str) -> KVPool:
    config = WorkerConfig(kv_layout=kv_layout, max_num_seqs=2, block_size=SHAPE.block_size)
    return layout_named(kv_layout).build_pool(config, SHAPE, MAX_LEN)


def test_each_setting_gets_its_pool() -> None:
    assert type(_pool("paged")) is DensePool
    assert type(_pool("contiguous")) is DensePool
    assert type(_pool("virtual")) is VirtualPool


@pytest.mark.parametrize("kv_layout", ["paged", "contiguous"])
def test_dense_pools_hold_the_budget_and_keep_released_blocks(kv_layout: str) -> None:
    kv_pool = _pool(kv_layout)
    pool = kv_pool.allocate(7, torch.device("cpu"), _allocate)
    assert pool.shape[2] == 7
    assert kv_pool.resident_bytes() is None
    pool.fill_(1.0)
    kv_pool.released([[0, 1, 2]])
    assert torch.count_nonzero(pool) == pool.numel()  # the manager reuses them as they are
    assert kv_pool.returned_ranges == 0


def test_virtual_pool_reserves_every_slot_and_returns_a_released_one_whole() -> None:
    kv_pool = _pool("virtual")
    assert kv_pool.resident_bytes() is None
    pool = kv_pool.allocate(7, torch.device("cpu"), _allocate)
    element = torch.empty((), dtype=SHAPE.dtype).element_size()
    geometry = virtual_geometry(
        2,
        MAX_LEN,
        SHAPE.block_size,
        SHAPE.block_size * SHAPE.num_kv_heads * SHAPE.head_dim * element,
    )
    assert pool.shape[2] == geometry.num_blocks  # the reservation, not the physical budget
    empty = kv_pool.resident_bytes()
    assert empty is not None
    slot = geometry.slot_blocks
    pool[:, :, : 2 * slot] = 1.0  # both slots written
    written = kv_pool.resident_bytes()
    assert written is not None and written > empty
    kv_pool.released(
        [[slot, slot + 1], []]
    )  # the second slot's sequence, and one never given blocks
    after = kv_pool.resident_bytes()
    assert after is not None and after < written
    assert torch.count_nonzero(pool[:, :, slot : 2 * slot]) == 0  # the whole slot, every plane
    assert torch.count_nonzero(pool[:, :, :slot]) == pool[:, :, :slot].numel()  # its neighbour
    assert kv_pool.returned_ranges == 1


def test_virtual_pool_refuses_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        _pool("virtual").allocate(7, torch.device("cuda", 0), _allocate)
