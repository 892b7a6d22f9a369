"""fp8 (e4m3) KV caches through the Triton kernels (the CUDA path; Triton's CPU interpreter where
no GPU exists): writes round each value to fp8 exactly as torch does, and attention over fp8
caches equals the plain-torch oracle over the same values widened to float32."""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import kv_quant, reference, triton_attention, triton_cache_ops, validation
from tests.kernels.cases import TOLERANCE, make_case, triton_device

FP8 = kv_quant.FP8_DTYPE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_rounds_to_fp8_and_touches_only_its_slots(dtype: torch.dtype) -> None:
    device = triton_device()
    k_cache = torch.zeros((4, 8, 2, 64), dtype=FP8, device=device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 2, 64, dtype=dtype) * 3
    value = torch.randn(3, 2, 64, dtype=dtype) * 3
    slots = torch.tensor([9, -1, 30])
    triton_cache_ops.write_kv(key.to(device), value.to(device), k_cache, v_cache, slots.to(device))
    flat_k = k_cache.cpu().view(torch.uint8).view(-1, 2, 64)
    flat_v = v_cache.cpu().view(torch.uint8).view(-1, 2, 64)
    assert torch.equal(flat_k[9], key[0].to(FP8).view(torch.uint8))
    assert torch.equal(flat_v[30], value[2].to(FP8).view(torch.uint8))
    others = [s for s in range(32) if s not in (9, 30)]
    assert not flat_k[others].any() and not flat_v[others].any()


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
def test_attention_over_fp8_caches_matches_the_oracle(
    query_dtype: torch.dtype, window: int | None
) -> None:
    lengths = [(33, 1), (20, 20), (17, 3), (48, 1)]
    case = make_case(lengths, block_size=16, head_dim=64, group=2, dtype=torch.float32)
    query = case.query.to(query_dtype)
    k_cache, v_cache = case.k_cache.to(FP8), case.v_cache.to(FP8)
    device = triton_device()
    batch = validation.check_paged_attention(
        query, k_cache, v_cache, case.cu_query_lens, case.context_lens, case.block_tables,
        case.scale, window, None,
    )  # fmt: skip
    out = torch.full_like(query, float("nan"), device=device)
    got = triton_attention.paged_attention(
        query.to(device), k_cache.to(device), v_cache.to(device),
        case.block_tables.to(device), batch, case.scale, window, out,
    ).cpu()  # fmt: skip
    expected = reference.paged_attention(
        query.float(), k_cache.float(), v_cache.float(), sliding_window=window, **case.kwargs()
    )
    tolerance = TOLERANCE[query_dtype]
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
    exact = reference.paged_attention(
        query.float(), case.k_cache, case.v_cache, sliding_window=window, **case.kwargs()
    )
    # what fp8's 3 mantissa bits cost the output against float32 caches
    assert (got.float() - exact).norm() / exact.norm() < 0.08
