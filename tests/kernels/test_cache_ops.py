"""KV write, block copy and block swap (CPU path and Triton) against the oracle.

The write tests prove the kernel-level half of "never overwrite another sequence": after a write,
every cache entry outside the written slots is bit-identical to before.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import pagedserve_kernels
from pagedserve_kernels import reference, triton_cache_ops
from tests.kernels.cases import DTYPES, triton_device

WriteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
CopyFn = Callable[[torch.Tensor, torch.Tensor], None]


def _triton_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor) -> None:  # fmt: skip
    """The Triton write on its device (CPU interpreter or CUDA), results copied back in place."""
    device = triton_device()
    k_dev, v_dev = k_cache.to(device), v_cache.to(device)
    triton_cache_ops.write_kv(key.to(device), value.to(device), k_dev, v_dev, slots.to(device))
    k_cache.copy_(k_dev)
    v_cache.copy_(v_dev)


def _triton_copy_blocks(kv_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    device = triton_device()
    pool_dev = kv_pool.to(device)
    triton_cache_ops.copy_blocks(pool_dev, pairs.to(device))
    kv_pool.copy_(pool_dev)


WRITERS: dict[str, WriteFn] = {"cpu": pagedserve_kernels.write_kv, "triton": _triton_write_kv}
COPIERS: dict[str, CopyFn] = {"cpu": pagedserve_kernels.copy_blocks, "triton": _triton_copy_blocks}


def _random_pool(num_layers: int, num_blocks: int, block_size: int, heads: int, head_dim: int,
                 dtype: torch.dtype, seed: int = 0) -> torch.Tensor:  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, num_blocks, block_size, heads, head_dim)
    return torch.randn(shape, generator=generator).to(dtype)


def test_allocate_kv_pool_layout() -> None:
    pool = pagedserve_kernels.allocate_kv_pool(
        num_layers=3, num_blocks=5, block_size=16, num_kv_heads=2, head_dim=64,
        dtype=torch.bfloat16, device="cpu",
    )  # fmt: skip
    assert pool.shape == (3, 2, 5, 16, 2, 64)
    assert pool.dtype == torch.bfloat16 and pool.is_contiguous() and not pool.any()
    assert pool[1, 0].shape == (5, 16, 2, 64) and pool[1, 0].is_contiguous()


@pytest.mark.parametrize("impl", sorted(WRITERS))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_touches_only_its_slots(impl: str, block_size: int, dtype: torch.dtype) -> None:
    pool = _random_pool(2, 6, block_size, 3, 64, dtype)
    k_cache, v_cache = pool[1, 0], pool[1, 1]
    generator = torch.Generator().manual_seed(block_size)
    num_slots = 6 * block_size
    # Shuffled slots: a block boundary, its neighbour, the last slot, and -1 padding between them.
    slots = torch.tensor([block_size - 1, block_size, num_slots - 1, -1, 0, -1, 2 * block_size + 3])
    key = torch.randn((slots.shape[0], 3, 64), generator=generator).to(dtype)
    value = torch.randn((slots.shape[0], 3, 64), generator=generator).to(dtype)
    expected = pool.clone()
    reference.write_kv(key, value, expected[1, 0], expected[1, 1], slots)
    before = pool.clone()
    WRITERS[impl](key, value, k_cache, v_cache, slots)
    assert torch.equal(pool, expected)
    written = torch.zeros(num_slots, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    untouched = pool[1].reshape(2, num_slots, 3, 64)[:, ~written]
    assert torch.equal(untouched, before[1].reshape(2, num_slots, 3, 64)[:, ~written])
    assert torch.equal(pool[0], before[0])  # another layer is never touched


@pytest.mark.parametrize("impl", sorted(WRITERS))
def test_write_kv_reads_strided_key_and_value(impl: str) -> None:
    pool = _random_pool(1, 4, 8, 2, 128, torch.float16)
    fused = torch.randn(5, 3, 2, 128).to(torch.float16)  # e.g. q|k|v heads from one projection
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.tensor([31, 7, -1, 8, 20])
    expected = pool.clone()
    reference.write_kv(key, value, expected[0, 0], expected[0, 1], slots)
    WRITERS[impl](key, value, pool[0, 0], pool[0, 1], slots)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("impl", sorted(COPIERS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference(impl: str, dtype: torch.dtype) -> None:
    pool = _random_pool(3, 9, 16, 2, 64, dtype, seed=1)
    pairs = torch.tensor([[4, 0], [4, 7], [2, 5], [8, 1]])
    expected = pool.clone()
    reference.copy_blocks(expected, pairs)
    COPIERS[impl](pool, pairs)
    assert torch.equal(pool, expected)


def test_copy_blocks_with_no_pairs_changes_nothing() -> None:
    pool = _random_pool(1, 3, 8, 1, 64, torch.float32)
    before = pool.clone()
    pagedserve_kernels.copy_blocks(pool, torch.empty((0, 2), dtype=torch.int64))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_between_cpu_pools_matches_reference(dtype: torch.dtype) -> None:
    device_pool = _random_pool(2, 7, 8, 2, 64, dtype, seed=2)
    cpu_pool = _random_pool(2, 4, 8, 2, 64, dtype, seed=3)
    out_pairs = torch.tensor([[6, 0], [1, 3], [3, 2]])
    expected = cpu_pool.clone()
    reference.swap_blocks(device_pool, expected, out_pairs)
    pagedserve_kernels.swap_blocks(device_pool, cpu_pool, out_pairs)
    assert torch.equal(cpu_pool, expected)
    in_pairs = torch.tensor([[0, 2], [3, 5]])
    expected_back = device_pool.clone()
    reference.swap_blocks(cpu_pool, expected_back, in_pairs)
    pagedserve_kernels.swap_blocks(cpu_pool, device_pool, in_pairs)
    assert torch.equal(device_pool, expected_back)
    assert torch.equal(device_pool[:, :, 2], expected[:, :, 0])  # block 6 went out and came back
