"""The public CPU path of paged_attention against the oracle over the grid: with the native
kernel taking every query row where it runs, and with the torch path it falls back to (padded
decode groups, SDPA prefill chunks) forced, so both hold on every CPU."""

from __future__ import annotations

import pytest
import torch

import pagedserve_kernels
from pagedserve_kernels import reference, torch_cpu
from pagedserve_kernels.metadata import prepare_attention
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
)


@pytest.fixture(autouse=True, params=["native", "torch"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test twice: as the model runs it (the native kernel where it is built and takes the
    operands), and on the torch path alone (what runs where the kernel does not)."""
    if request.param == "torch":
        monkeypatch.setattr(torch_cpu.attention_cpu, "accepts", lambda *operands: False)
    return str(request.param)


def _both(case: AttentionCase, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    got = pagedserve_kernels.paged_attention(
        case.query, case.k_cache, case.v_cache, sliding_window=window, **case.kwargs()
    )
    expected = reference.paged_attention(
        case.query, case.k_cache, case.v_cache, sliding_window=window, **case.kwargs()
    )
    return got, expected


@pytest.mark.parametrize("params", covering_grid(), ids=grid_id)
def test_cpu_attention_matches_reference(params: tuple[int, str, int, int, torch.dtype]) -> None:
    block_size, kind, group, head_dim, dtype = params
    lengths = lengths_for(kind, block_size)
    case = make_case(lengths, block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)
    got, expected = _both(case)
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_sliding_window_matches_reference(block_size: int, kind: str) -> None:
    dtype = DTYPES[(block_size // 8 + len(kind)) % len(DTYPES)]
    lengths = lengths_for(kind, block_size)
    case = make_case(lengths, block_size=block_size, head_dim=64, group=3, dtype=dtype)
    got, expected = _both(case, window=block_size // 2 + 3)
    assert_close(got, expected, dtype)


def test_cpu_attention_writes_into_out_and_reads_strided_query() -> None:
    lengths = lengths_for("mixed", 8)
    case = make_case(lengths, block_size=8, head_dim=64, group=2, dtype=torch.float32)
    num_tokens = case.query.shape[0]
    # A query sliced out of a fused QKV projection: not contiguous.
    fused = torch.randn(num_tokens, 8, 64)
    fused[:, :4] = case.query
    query = fused[:, :4]
    assert not query.is_contiguous()
    out = torch.full_like(case.query, float("nan"))
    returned = pagedserve_kernels.paged_attention(
        query, case.k_cache, case.v_cache, out=out, **case.kwargs()
    )
    assert returned is out
    expected = reference.paged_attention(case.query, case.k_cache, case.v_cache, **case.kwargs())
    assert_close(out, expected, torch.float32)


def test_cpu_attention_long_decode_with_int64_metadata() -> None:
    lengths = [(300, 1), (129, 1), (64, 3)]
    case = make_case(lengths, block_size=16, head_dim=64, group=3, dtype=torch.float32, seed=7)
    got = pagedserve_kernels.paged_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        cu_query_lens=case.cu_query_lens.long(),
        context_lens=case.context_lens.long(),
        block_tables=case.block_tables.long(),
        scale=case.scale,
    )
    expected = reference.paged_attention(case.query, case.k_cache, case.v_cache, **case.kwargs())
    assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("head_dim", [32, 80, 256])
def test_cpu_other_head_dims_match_reference(head_dim: int) -> None:
    case = make_case(
        lengths_for("mixed", 16), block_size=16, head_dim=head_dim, group=2, dtype=torch.float32
    )
    got, expected = _both(case, window=11)
    assert_close(got, expected, torch.float32)


def _folded_groups(case: AttentionCase) -> list[bool]:
    """Per decode group of the case's prepared metadata: whether it takes `_all_heads`."""
    prepared = prepare_attention(
        case.cu_query_lens,
        case.context_lens,
        case.block_tables,
        num_blocks=case.k_cache.shape[0],
        block_size=case.k_cache.shape[1],
    )
    num_kv_heads = case.k_cache.shape[2]
    return [
        torch_cpu._folds(case.k_cache.dtype, num_kv_heads, group.num_seqs)
        for group in prepared.decode_groups
    ]


RAGGED_DECODES = [(16, 1), (17, 1), (31, 1), (32, 1), (33, 1), (1, 1), (47, 1), (40, 1)]
"""Contexts on, one past and one short of block boundaries, a one-token context: one group."""


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (1, 4, 64), (4, 1, 128), (2, 2, 32)]
)
@pytest.mark.parametrize("window", [None, 9])
def test_cpu_folded_decodes_match_reference(
    num_kv_heads: int, group: int, head_dim: int, window: int | None
) -> None:
    """bfloat16 decode groups of >= FOLDED_MIN_SEQS sequences (ragged contexts, partial last
    blocks, GQA, MQA and MHA, sliding window) attend by `_all_heads`, within tolerance."""
    case = make_case(
        RAGGED_DECODES,
        block_size=16,
        head_dim=head_dim,
        group=group,
        dtype=torch.bfloat16,
        num_kv_heads=num_kv_heads,
        seed=num_kv_heads * 10 + group,
    )
    assert any(_folded_groups(case))
    got, expected = _both(case, window=window)
    assert_close(got, expected, torch.bfloat16)


def test_cpu_folded_and_sdpa_decodes_mixed_with_prefills() -> None:
    """A step with a prefill chunk, a folded decode group and a small SDPA decode group."""
    lengths = [(40, 12), *RAGGED_DECODES, (200, 1), (190, 0)]
    case = make_case(lengths, block_size=16, head_dim=64, group=3, dtype=torch.bfloat16, seed=3)
    folded = _folded_groups(case)
    assert True in folded and False in folded
    got, expected = _both(case)
    assert_close(got, expected, torch.bfloat16)


def test_cpu_many_kv_heads_or_float_caches_keep_sdpa() -> None:
    assert not torch_cpu._folds(torch.bfloat16, torch_cpu.FOLDED_MAX_KV_HEADS + 1, 16)
    assert not torch_cpu._folds(torch.float32, 3, 16)
    assert not torch_cpu._folds(torch.bfloat16, 3, torch_cpu.FOLDED_MIN_SEQS - 1)
    assert torch_cpu._folds(torch.bfloat16, 3, torch_cpu.FOLDED_MIN_SEQS)
