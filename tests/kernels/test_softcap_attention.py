"""Soft-capped attention scores (`cap * tanh(s / cap)`, Gemma 2) on every attention path.

The oracle is `pagedserve_kernels.reference.paged_attention`, itself checked here against a direct
computation of one sequence; the CPU path (whose native decode kernel has no soft cap, so capped
calls take the torch path) and the Triton kernel (the CPU interpreter here) must match it, with
and without a sliding window.
"""

from __future__ import annotations

import pytest
import torch

import pagedserve_kernels
from pagedserve_kernels import reference, triton_attention, validation
from tests.kernels.cases import (
    KINDS,
    AttentionCase,
    assert_close,
    lengths_for,
    make_case,
    triton_device,
)

SOFTCAP = 1.0
"""Scores of the random cases are about N(0, 1): a cap of 1 changes every softmax."""


def _case(kind: str, dtype: torch.dtype, block_size: int = 8) -> AttentionCase:
    return make_case(
        lengths_for(kind, block_size), block_size=block_size, head_dim=64, group=3, dtype=dtype
    )


def _reference(case: AttentionCase, window: int | None, softcap: float | None) -> torch.Tensor:
    return reference.paged_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        sliding_window=window,
        softcap=softcap,
        **case.kwargs(),
    )


def test_reference_caps_the_scores_of_one_sequence() -> None:
    case = make_case([(11, 3)], block_size=4, head_dim=32, group=2, dtype=torch.float32)
    table = case.block_tables[0]
    keys = reference.gather_context(case.k_cache, table, 11).repeat_interleave(2, dim=1)
    values = reference.gather_context(case.v_cache, table, 11).repeat_interleave(2, dim=1)
    expected = []
    for j, position in enumerate(range(8, 11)):
        scores = torch.einsum("hd,nhd->hn", case.query[j], keys[: position + 1]) * case.scale
        weights = torch.softmax(torch.tanh(scores / SOFTCAP) * SOFTCAP, dim=-1)
        expected.append(torch.einsum("hn,nhd->hd", weights, values[: position + 1]))
    got = _reference(case, None, SOFTCAP)
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, _reference(case, None, None), atol=1e-3)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_path_caps_like_the_reference(
    kind: str, dtype: torch.dtype, window: int | None
) -> None:
    case = _case(kind, dtype)
    got = pagedserve_kernels.paged_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        sliding_window=window,
        softcap=SOFTCAP,
        **case.kwargs(),
    )
    assert_close(got, _reference(case, window, SOFTCAP), dtype)


@pytest.mark.parametrize(("kind", "num_splits"), [("decode", 1), ("mixed", 1), ("decode", 3)])
@pytest.mark.parametrize("window", [None, 7])
def test_triton_caps_like_the_reference(kind: str, num_splits: int, window: int | None) -> None:
    dtype = torch.float32
    case = _case(kind, dtype).to(triton_device())
    batch = validation.check_paged_attention(
        case.query, case.k_cache, case.v_cache, case.cu_query_lens, case.context_lens,
        case.block_tables, case.scale, window, None, SOFTCAP,
    )  # fmt: skip
    out = torch.full_like(case.query, float("nan"))
    got = triton_attention.paged_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, batch, case.scale, window,
        out, num_splits=num_splits, softcap=SOFTCAP,
    )  # fmt: skip
    assert_close(got.cpu(), _reference(case.to("cpu"), window, SOFTCAP), dtype)


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), float("nan"), True])
def test_a_bad_softcap_is_refused(softcap: float) -> None:
    case = _case("decode", torch.float32)
    with pytest.raises(ValueError, match="softcap must be None or a positive finite number"):
        pagedserve_kernels.paged_attention(
            case.query, case.k_cache, case.v_cache, softcap=softcap, **case.kwargs()
        )
