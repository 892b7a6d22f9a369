"""The non-paged attention path against the plain-torch reference paged attention."""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import reference
from pagedserve_kernels.range_attention import contiguous_runs, range_attention


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_paged_attention(sliding_window: int | None, dtype: torch.dtype) -> None:
    """A mixed batch (prefill chunks after a cached prefix, a fresh prompt, decodes) with GQA,
    each sequence's KV in its own contiguous run of blocks."""
    generator = torch.Generator().manual_seed(7)
    block_size, kv_heads, q_heads, head_dim = 4, 2, 6, 32
    k_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    query_lens, context_lens, firsts = [5, 1, 7, 1], [13, 9, 7, 30], [0, 8, 12, 20]
    cu = [0]
    for q_len in query_lens:
        cu.append(cu[-1] + q_len)
    query = torch.randn(cu[-1], q_heads, head_dim, generator=generator).to(dtype)
    width = max(-(-c // block_size) for c in context_lens)
    tables = torch.zeros(len(firsts), width, dtype=torch.int32)
    for row, (first, context) in enumerate(zip(firsts, context_lens, strict=True)):
        blocks = -(-context // block_size)
        tables[row, :blocks] = torch.arange(first, first + blocks)
    expected = reference.paged_attention(
        query,
        k_cache,
        v_cache,
        cu_query_lens=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=tables,
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
    )
    got = range_attention(
        query,
        k_cache,
        v_cache,
        query_starts=cu[:-1],
        query_lens=query_lens,
        context_lens=context_lens,
        first_blocks=firsts,
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_contiguous_runs_rejects_a_scattered_table() -> None:
    assert contiguous_runs([[3, 4, 5], [9], []]) == [3, 9, 0]
    with pytest.raises(ValueError, match="not one contiguous run"):
        contiguous_runs([[3, 5]])
