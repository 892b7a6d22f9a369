"""Sliding-window attention over hybrid KV group tables: blocks a window has passed are the null
block (`block_manager.hybrid`), and no attention path may read it inside the window.

Each case is a mixed batch (a prefill chunk continuing a long cached prefix, decodes far past
the window, a whole short prompt) under a window of 6 with blocks of 4. The hybrid tables
replace every block wholly below the window of a sequence's first query with one extra null
block full of large garbage; the oracle is the plain-torch reference over the full tables.
Every path must agree with it: the native CPU kernel (float32, bfloat16), the torch path
(float16; a soft cap), and the Triton kernel (under the interpreter on CPU).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import paged_attention, reference, triton_attention, validation
from tests.kernels.cases import AttentionCase, assert_close, make_case, triton_device

WINDOW = 6
BLOCK = 4
LENGTHS = [(21, 5), (17, 1), (30, 1), (13, 13), (9, 1)]
"""(context, queries): a chunk at 16..20, decodes at 16, 29 and 8, a whole prompt of 13."""


def _hybrid(case: AttentionCase) -> AttentionCase:
    """The case with one more block (the null block: garbage) and, per sequence, every block
    below its first query's window pointing at it."""
    garbage = torch.randn((1, *case.k_cache.shape[1:])) * 8.0
    k_cache = torch.cat([case.k_cache, garbage.to(case.k_cache.dtype)])
    v_cache = torch.cat([case.v_cache, garbage.to(case.v_cache.dtype)])
    null = case.k_cache.shape[0]
    tables = case.block_tables.clone()
    for seq, (context, queries) in enumerate(LENGTHS):
        first_query = context - queries
        dropped = max(0, first_query - WINDOW + 1) // BLOCK
        tables[seq, :dropped] = null
    assert (tables == null).any()
    return AttentionCase(
        case.query, k_cache, v_cache, case.cu_query_lens, case.context_lens, tables, case.scale
    )


def _expected(case: AttentionCase, softcap: float | None = None) -> torch.Tensor:
    return reference.paged_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        sliding_window=WINDOW,
        softcap=softcap,
        **case.kwargs(),
    )


@pytest.mark.parametrize(
    ("dtype", "softcap"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None), (torch.float32, 2.0)],
)
def test_cpu_paths_never_read_the_null_block_inside_the_window(
    dtype: torch.dtype, softcap: float | None
) -> None:
    case = make_case(LENGTHS, block_size=BLOCK, head_dim=64, group=2, dtype=dtype)
    hybrid = _hybrid(case)
    actual = paged_attention(
        hybrid.query,
        hybrid.k_cache,
        hybrid.v_cache,
        sliding_window=WINDOW,
        softcap=softcap,
        **hybrid.kwargs(),
    )
    assert_close(actual, _expected(case, softcap), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_never_reads_the_null_block_inside_the_window(dtype: torch.dtype) -> None:
    case = make_case(LENGTHS, block_size=BLOCK, head_dim=64, group=2, dtype=dtype)
    hybrid = _hybrid(case).to(triton_device())
    batch = validation.check_paged_attention(
        hybrid.query, hybrid.k_cache, hybrid.v_cache, hybrid.cu_query_lens,
        hybrid.context_lens, hybrid.block_tables, hybrid.scale, WINDOW, None,
    )  # fmt: skip
    out = torch.full_like(hybrid.query, float("nan"))
    result = triton_attention.paged_attention(
        hybrid.query, hybrid.k_cache, hybrid.v_cache, hybrid.block_tables, batch,
        hybrid.scale, WINDOW, out,
    )  # fmt: skip
    assert_close(result.cpu(), _expected(case), dtype)
