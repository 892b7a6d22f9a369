"""The virtual pool commits memory on first touch and returns it on decommit (real page faults)."""

from __future__ import annotations

import resource

import pytest
import torch

from kv_layouts.virtual import PAGE_BYTES, virtual_geometry
from kv_layouts.virtual_pool import VirtualKVPool
from pagedserve_kernels import write_kv

LAYERS, BLOCK, HEADS, DIM = 2, 16, 2, 32  # one block of one plane = 4 KiB in float32


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _pool(num_slots: int = 4, max_len: int = 4096) -> tuple[VirtualKVPool, int]:
    geometry = virtual_geometry(num_slots, max_len, BLOCK, BLOCK * HEADS * DIM * 4)
    pool = VirtualKVPool(LAYERS, geometry.num_blocks, BLOCK, HEADS, DIM, torch.float32)
    return pool, geometry.slot_blocks


def _write(pool: VirtualKVPool, first_block: int, tokens: int) -> int:
    """Write `tokens` tokens of K and V into every layer from `first_block`; returns the minor
    page faults the writes took (inputs are built before counting)."""
    key = torch.ones(tokens, HEADS, DIM)
    slots = torch.arange(first_block * BLOCK, first_block * BLOCK + tokens)
    planes = [(pool.tensor[layer, 0], pool.tensor[layer, 1]) for layer in range(LAYERS)]
    scratch = torch.zeros(tokens // BLOCK + 1, BLOCK, HEADS, DIM)
    write_kv(key, key, scratch, scratch.clone(), slots - slots[0])  # first-call setup, uncounted
    before = _faults()
    for k_cache, v_cache in planes:
        write_kv(key, key, k_cache, v_cache, slots)
    return _faults() - before


def test_geometry_aligns_slots_and_commit_units_to_pages() -> None:
    geometry = virtual_geometry(3, 100, 8, 2048)  # two blocks per page
    assert geometry.commit_blocks == 2 and geometry.slot_blocks == 14
    assert (geometry.slot_blocks * 2048) % PAGE_BYTES == 0
    with pytest.raises(ValueError, match="must be positive"):
        virtual_geometry(0, 100, 8, 2048)


def test_reserving_commits_nothing() -> None:
    pool, _ = _pool(num_slots=16)
    assert pool.nbytes >= 16 * 4096 * 1024  # 64 MiB of address space for K and V
    assert pool.resident_bytes() == 0


@pytest.mark.parametrize("tokens", [16 * 8, 16 * 64])
def test_faults_follow_tokens_written_not_the_reserved_range(tokens: int) -> None:
    """Each written block of each plane (4 KiB) is one page: resident memory is exactly the
    pages written and the page faults taken are about as many, far below the reserved range."""
    pool, slot_blocks = _pool(max_len=16384)
    written_pages = 2 * LAYERS * (tokens // BLOCK)
    reserved_pages = 2 * LAYERS * slot_blocks
    faults = _write(pool, slot_blocks, tokens)  # slot 1
    assert pool.resident_bytes() == written_pages * PAGE_BYTES
    assert written_pages <= faults <= written_pages + 32
    assert faults < reserved_pages // 4


def test_decommit_returns_to_baseline_and_zeroes() -> None:
    pool, slot_blocks = _pool()
    _write(pool, 0, 100)
    _write(pool, slot_blocks, 40)
    assert pool.resident_bytes() == 2 * LAYERS * (7 + 3) * PAGE_BYTES
    pool.decommit([(0, 7)])
    assert pool.resident_bytes() == 2 * LAYERS * 3 * PAGE_BYTES
    assert float(pool.tensor[1, 1, slot_blocks, 0].sum()) == HEADS * DIM  # neighbour intact
    pool.decommit([(slot_blocks, slot_blocks + 3)])
    assert pool.resident_bytes() == 0
    # Reads of returned pages see zeros (mincore then counts the shared zero page as mapped;
    # the engine never reads a slot it has not written).
    assert float(pool.tensor[:, :, :7].abs().sum()) == 0.0


def test_decommit_rejects_bad_ranges() -> None:
    pool, _ = _pool()
    with pytest.raises(ValueError, match="outside"):
        pool.decommit([(0, 10**9)])
