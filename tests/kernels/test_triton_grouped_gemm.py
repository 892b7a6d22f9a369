"""The Triton grouped matmul of mixture-of-experts layers against one torch product per expert
(the CPU interpreter here, native on CUDA): uneven groups, an empty expert, sizes off the tile
grid, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels.triton_grouped_gemm import grouped_matmul
from tests.kernels.cases import triton_device


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_is_one_product_per_expert(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    counts = [5, 0, 19, 1, 33]
    k, n = 40, 24
    x = torch.randn(sum(counts), k, generator=generator).to(dtype)
    weights = torch.randn(len(counts), n, k, generator=generator).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    device = triton_device()
    got = grouped_matmul(x.to(device), weights.to(device), offsets.to(device)).cpu()
    expected = torch.cat(
        [x[offsets[e] : offsets[e + 1]].float() @ weights[e].float().T for e in range(len(counts))]
    )
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def test_grouped_matmul_refuses_offsets_that_do_not_cover_the_rows() -> None:
    x, weights = torch.zeros(4, 8), torch.zeros(2, 3, 8)
    with pytest.raises(ValueError, match="offsets must rise from 0 to the row count"):
        grouped_matmul(x, weights, torch.tensor([0, 3, 2]))


def test_moe_expert_products_agree_on_both_paths() -> None:
    """`SparseMoE.expert_products` by the Triton grouped matmul equals its per-expert torch
    products (float32)."""
    from workers.config import ModelSpec, ModelVariant, RopeSpec
    from workers.moe import SparseMoE
    from workers.parallel import TensorParallel

    spec = ModelSpec(
        "qwen3_moe", 64, 32, 48, 1, 2, 1, 16, 1e-6, 64, RopeSpec(), False, False, True,
        (None,), None, (),
        ModelVariant(num_experts=4, experts_per_token=2, expert_intermediate_size=24),
    )  # fmt: skip
    moe = SparseMoE(spec, 0, TensorParallel(), torch.float32)
    generator = torch.Generator().manual_seed(5)
    moe.gate_up.copy_(torch.randn(moe.gate_up.shape, generator=generator))
    moe.down.copy_(torch.randn(moe.down.shape, generator=generator))
    counts = [3, 0, 7, 2]
    rows = torch.randn(sum(counts), 32, generator=generator)
    device = triton_device()
    by_torch = moe.expert_products(rows, counts, triton=False)
    by_triton = moe.to(device).expert_products(rows.to(device), counts, triton=True).cpu()
    torch.testing.assert_close(by_triton, by_torch, atol=1e-3, rtol=1e-4)
