"""The Triton paged-attention kernel against the oracle (CPU interpreter here, native on CUDA).

Calls the Triton entry point directly: the public dispatcher uses Triton only for CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import reference, triton_attention, validation
from pagedserve_kernels.validation import AttentionBatch
from tests.kernels.cases import (
    BLOCK_SIZES,
    DTYPES,
    KINDS,
    AttentionCase,
    assert_close,
    covering_grid,
    grid_id,
    lengths_for,
    make_case,
    triton_device,
)


def run_triton(
    case: AttentionCase, *, window: int | None = None, num_splits: int | None = None
) -> torch.Tensor:
    case = case.to(triton_device())
    batch = validation.check_paged_attention(
        case.query, case.k_cache, case.v_cache, case.cu_query_lens, case.context_lens,
        case.block_tables, case.scale, window, None,
    )  # fmt: skip
    out = torch.full_like(case.query, float("nan"))
    result = triton_attention.paged_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, batch, case.scale, window, out,
        num_splits=num_splits,
    )  # fmt: skip
    return result.cpu()


def run_reference(case: AttentionCase, *, window: int | None = None) -> torch.Tensor:
    return reference.paged_attention(
        case.query, case.k_cache, case.v_cache, sliding_window=window, **case.kwargs()
    )


@pytest.mark.parametrize("params", covering_grid(), ids=grid_id)
def test_triton_attention_matches_reference(params: tuple[int, str, int, int, torch.dtype]) -> None:
    block_size, kind, group, head_dim, dtype = params
    lengths = lengths_for(kind, block_size)
    case = make_case(lengths, block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)
    assert_close(run_triton(case), run_reference(case), dtype)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_triton_sliding_window_matches_reference(block_size: int, kind: str) -> None:
    dtype = DTYPES[(block_size // 8 + len(kind)) % len(DTYPES)]
    case = make_case(
        lengths_for(kind, block_size), block_size=block_size, head_dim=64, group=3, dtype=dtype
    )
    window = block_size // 2 + 3
    assert_close(run_triton(case, window=window), run_reference(case, window=window), dtype)


@pytest.mark.parametrize(
    ("kind", "num_splits", "window", "dtype"),
    [
        ("decode", 3, None, torch.float32),
        ("decode", 4, 20, torch.bfloat16),
        ("mixed", 2, None, torch.float16),
        ("prefill", 3, 9, torch.float32),
    ],
)
def test_triton_split_kv_matches_reference(
    kind: str, num_splits: int, window: int | None, dtype: torch.dtype
) -> None:
    # Contexts of up to 3 partitions of 64 keys: splits cover, straddle and miss sequences.
    lengths = [*lengths_for(kind, 16), (150, 1), (129, 2)]
    case = make_case(lengths, block_size=16, head_dim=64, group=4, dtype=dtype, seed=3)
    got = run_triton(case, window=window, num_splits=num_splits)
    assert_close(got, run_reference(case, window=window), dtype)


def test_triton_attention_reads_strided_query_and_cache_views() -> None:
    case = make_case(
        lengths_for("mixed", 8), block_size=8, head_dim=64, group=2, dtype=torch.float32
    )
    pool = torch.stack([case.k_cache, case.v_cache]).unsqueeze(0)  # [1, 2, N, bs, H, D]
    fused = torch.randn(case.query.shape[0], 8, 64)
    fused[:, 2:6] = case.query
    strided = AttentionCase(
        fused[:, 2:6], pool[0, 0], pool[0, 1], case.cu_query_lens, case.context_lens,
        case.block_tables, case.scale,
    )  # fmt: skip
    assert_close(run_triton(strided), run_reference(case), torch.float32)


def _batch(query_lens: list[int], context_lens: list[int], group: int = 3) -> AttentionBatch:
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    return AttentionBatch(tuple(starts), tuple(query_lens), tuple(context_lens), 16, 3, group, 64)


def test_plan_splits_few_long_decodes_and_not_a_full_batch() -> None:
    few_long = triton_attention.plan_launch(_batch([1, 1], [8192, 4000]), num_programs_target=264)
    assert few_long.num_splits > 1
    assert few_long.partition_size * few_long.num_splits >= 8192
    assert few_long.partition_size % few_long.block_n == 0
    many = triton_attention.plan_launch(_batch([1] * 256, [2048] * 256), num_programs_target=264)
    assert many.num_splits == 1
    short = triton_attention.plan_launch(_batch([1, 1], [100, 30]), num_programs_target=264)
    assert short.num_splits == 1


def test_plan_tiles_hold_whole_query_groups() -> None:
    for group in (1, 3, 4, 7, 16, 32):
        for q_len in (1, 5, 300):
            plan = triton_attention.plan_launch(
                _batch([q_len], [q_len], group), num_programs_target=1
            )
            assert plan.block_m >= group
            assert plan.block_m & (plan.block_m - 1) == 0


@pytest.mark.parametrize("head_dim", [32, 80, 256])
def test_triton_other_head_dims_match_reference(head_dim: int) -> None:
    # 32: the workers' tiny test models; 80: not a power of two (masked lanes); 256: narrow tiles.
    case = make_case(
        lengths_for("mixed", 16), block_size=16, head_dim=head_dim, group=2, dtype=torch.float16
    )
    assert_close(run_triton(case, window=11), run_reference(case, window=11), torch.float16)
