"""The large grid natively on CUDA: the public dispatcher (Triton) against the oracle on the CPU.

Marked ``gpu``: skipped where CUDA is absent (tests/conftest.py). ``benchmarks/gpu_check.sh`` runs
these on a machine with a GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import pagedserve_kernels
from pagedserve_kernels import reference, triton_attention
from tests.kernels.cases import (
    BLOCK_SIZES,
    DTYPES,
    GROUPS,
    HEAD_DIMS,
    KINDS,
    assert_close,
    lengths_for,
    make_case,
)

pytestmark = pytest.mark.gpu

# Every block size x head dim x group x dtype (54 kernel specialisations) with the batch kind
# cycled so that each kind meets each dtype and each block size; every case with and without a
# sliding window (a runtime argument: no extra compilations).
LARGE_GRID = [
    (*params, KINDS[(index + index // 3) % 3])
    for index, params in enumerate(itertools.product(BLOCK_SIZES, HEAD_DIMS, GROUPS, DTYPES))
]


def _scaled_lengths(kind: str, block_size: int) -> list[tuple[int, int]]:
    """The CI lengths plus longer sequences (several blocks, a long prefill chunk)."""
    longer = [(7 * block_size, 1), (9 * block_size + 1, 3 * block_size + 5), (300, 1)]
    return lengths_for(kind, block_size) + longer


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize(
    ("block_size", "head_dim", "group", "dtype", "kind"),
    LARGE_GRID,
    ids=[f"bs{b}-d{d}-g{g}-{str(t).removeprefix('torch.')}-{k}" for b, d, g, t, k in LARGE_GRID],
)
def test_cuda_attention_matches_reference(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype, kind: str, window: int | None
) -> None:
    case = make_case(
        _scaled_lengths(kind, block_size), block_size=block_size, head_dim=head_dim, group=group,
        dtype=dtype, num_kv_heads=2, seed=block_size + head_dim + group,
    )  # fmt: skip
    expected = reference.paged_attention(
        case.query, case.k_cache, case.v_cache, sliding_window=window, **case.kwargs()
    )
    device_case = case.to("cuda")
    got = pagedserve_kernels.paged_attention(
        device_case.query, device_case.k_cache, device_case.v_cache, sliding_window=window,
        **device_case.kwargs(),
    )  # fmt: skip
    assert got.is_cuda
    assert_close(got.cpu(), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_few_long_decodes_take_the_split_path(dtype: torch.dtype) -> None:
    lengths = [(4000, 1), (2500, 1)]
    case = make_case(lengths, block_size=16, head_dim=128, group=4, dtype=dtype, num_kv_heads=1)
    expected = reference.paged_attention(case.query, case.k_cache, case.v_cache, **case.kwargs())
    device_case = case.to("cuda")
    got = pagedserve_kernels.paged_attention(
        device_case.query, device_case.k_cache, device_case.v_cache, **device_case.kwargs()
    )
    assert_close(got.cpu(), expected, dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    from pagedserve_kernels.validation import check_paged_attention

    batch = check_paged_attention(
        case.query, case.k_cache, case.v_cache, case.cu_query_lens, case.context_lens,
        case.block_tables, case.scale, None, None,
    )  # fmt: skip
    assert triton_attention.plan_launch(batch, num_programs_target=2 * sms).num_splits > 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_write_kv_touches_only_its_slots(dtype: torch.dtype) -> None:
    pool = torch.randn(2, 2, 64, 16, 4, 128).to(dtype)
    slots = torch.randperm(64 * 16)[:300]
    slots[::7] = -1
    key = torch.randn(300, 4, 128).to(dtype)
    value = torch.randn(300, 4, 128).to(dtype)
    expected = pool.clone()
    reference.write_kv(key, value, expected[1, 0], expected[1, 1], slots)
    device_pool = pool.cuda()
    pagedserve_kernels.write_kv(
        key.cuda(), value.cuda(), device_pool[1, 0], device_pool[1, 1], slots.cuda()
    )
    assert torch.equal(device_pool.cpu(), expected)


def test_cuda_copy_blocks_matches_reference() -> None:
    pool = torch.randn(4, 2, 50, 16, 2, 128).to(torch.bfloat16)
    pairs = torch.tensor([[3, 10], [3, 11], [40, 0], [7, 49]])
    expected = pool.clone()
    reference.copy_blocks(expected, pairs)
    device_pool = pool.cuda()
    pagedserve_kernels.copy_blocks(device_pool, pairs.cuda())
    assert torch.equal(device_pool.cpu(), expected)


def test_cuda_swap_out_and_in_through_pinned_memory() -> None:
    device_pool = pagedserve_kernels.allocate_kv_pool(
        num_layers=3, num_blocks=20, block_size=16, num_kv_heads=2, head_dim=64,
        dtype=torch.float16, device="cuda",
    )  # fmt: skip
    device_pool.copy_(torch.randn(device_pool.shape).to(torch.float16))
    cpu_pool = pagedserve_kernels.allocate_kv_pool(
        num_layers=3, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=64,
        dtype=torch.float16, device="cpu", pin_memory=True,
    )  # fmt: skip
    assert cpu_pool.is_pinned()
    out_pairs = torch.tensor([[19, 0], [4, 5], [7, 3]])
    expected_cpu = cpu_pool.clone()
    reference.swap_blocks(device_pool.cpu(), expected_cpu, out_pairs)
    pagedserve_kernels.swap_blocks(device_pool, cpu_pool, out_pairs)
    assert torch.equal(cpu_pool, expected_cpu)
    in_pairs = torch.tensor([[0, 1], [3, 2]])
    expected_device = device_pool.cpu()
    reference.swap_blocks(cpu_pool, expected_device, in_pairs)
    pagedserve_kernels.swap_blocks(cpu_pool, device_pool, in_pairs)
    torch.cuda.synchronize()
    assert torch.equal(device_pool.cpu(), expected_device)


def test_cuda_bad_slot_raises_before_launch() -> None:
    pool = torch.zeros(1, 2, 4, 8, 1, 64, device="cuda")
    with pytest.raises(ValueError, match="slots outside"):
        pagedserve_kernels.write_kv(
            torch.ones(2, 1, 64, device="cuda"), torch.ones(2, 1, 64, device="cuda"),
            pool[0, 0], pool[0, 1], torch.tensor([0, 32], device="cuda"),
        )  # fmt: skip
    assert not pool.any()
