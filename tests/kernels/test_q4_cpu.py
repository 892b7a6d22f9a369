"""The CPU 4-bit kernel (`pagedserve_kernels.q4_cpu`) against plain torch: the exact recovery of
GGUF Q4_1 blocks from dequantized float32 weights, and products equal to float32 (float64 as the
oracle) over the dequantized weights, in float32 and bfloat16."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedserve_kernels import q4_cpu
from pagedserve_kernels.q4_cpu import Q4Weight, q4_matmul
from tests.kernels.cpu_features import (
    cpu_has_avx2_fma,
    cpu_vector_isas,
    each_isa,
    needs_vector_kernels,
)
from tests.kernels.gguf_blocks import gguf_blocks, within_float32_summation

needs_kernel = needs_vector_kernels


def gguf_q4_1(rows: int, cols: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    return gguf_blocks(gguf.GGMLQuantizationType.Q4_1, rows, cols, seed)


def test_kernel_is_built_wherever_the_cpu_runs_it() -> None:
    """pip builds the library at install time; a missing build on an AVX2 machine is a
    failure here, not a silent fallback to the dense product."""
    assert q4_cpu.available() == cpu_has_avx2_fma()
    assert q4_cpu.supported_isas() == cpu_vector_isas()


@pytest.mark.parametrize(("rows", "cols"), [(1, 32), (7, 96), (96, 576), (130, 1536)])
def test_recover_finds_gguf_q4_1_blocks_exactly(rows: int, cols: int) -> None:
    blocks, dequantized = gguf_q4_1(rows, cols, seed=rows)
    recovered = Q4Weight.recover(dequantized)
    assert recovered is not None
    assert recovered.shape == (rows, cols)
    assert torch.equal(recovered.dequantize(), dequantized)
    # the same codes and scales the file holds: per block fp16 d, fp16 m, 16 code bytes
    raw = blocks.reshape(rows, cols // 32, 20)
    scales = raw[:, :, 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    mins = raw[:, :, 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
    assert torch.equal(recovered.mins, torch.from_numpy(mins))
    nonconstant = recovered.scales != 0
    assert torch.equal(recovered.scales[nonconstant], torch.from_numpy(scales)[nonconstant])
    codes = torch.from_numpy(raw[:, :, 4:].reshape(rows, cols // 2).copy())
    block_nonconstant = nonconstant.repeat_interleave(16, dim=1)
    assert torch.equal(recovered.codes[block_nonconstant], codes[block_nonconstant])


def test_recover_handles_constant_and_zero_blocks() -> None:
    weight = torch.zeros(3, 64)
    weight[1, :32] = 0.5
    weight[2, 32:] = -1.25
    recovered = Q4Weight.recover(weight)
    assert recovered is not None
    assert torch.equal(recovered.dequantize(), weight)


@pytest.mark.parametrize(
    "weight",
    [
        torch.randn(8, 64),  # dense float32 weights: no 4-bit form
        torch.randn(8, 48),  # width not a multiple of 32
        torch.randn(8, 64).bfloat16(),  # not float32
        torch.full((2, 32), float("nan")),
    ],
    ids=["random", "width", "dtype", "nan"],
)
def test_recover_refuses_what_has_no_exact_4_bit_form(weight: torch.Tensor) -> None:
    assert Q4Weight.recover(weight) is None


def test_recover_refuses_a_matrix_exact_only_in_its_first_row() -> None:
    _, dequantized = gguf_q4_1(4, 64, seed=3)
    dequantized[2, 5] += 1e-3
    assert Q4Weight.recover(dequantized) is None


@needs_kernel
@each_isa
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, 16])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 32), (6, 64), (7, 96), (130, 576)])
def test_float32_product_equals_float32_matmul_over_the_dequantized_weights(
    isa: str, rows: int, out_features: int, in_features: int
) -> None:
    _, dequantized = gguf_q4_1(out_features, in_features, seed=out_features + rows)
    weight = Q4Weight.recover(dequantized)
    assert weight is not None
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    got = q4_matmul(x, weight, isa=isa)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert within_float32_summation(got, x, dequantized)


@needs_kernel
@each_isa
def test_kernel_reads_each_weight_exactly_as_dequantize_gives_it(isa: str) -> None:
    """One-hot rows pick single weights out of the product (the other terms are exact zeros):
    the kernel's fused multiply-add gives every weight bit for bit as `dequantize` does."""
    _, dequantized = gguf_q4_1(50, 128, seed=4)
    weight = Q4Weight.recover(dequantized)
    assert weight is not None
    for columns in (range(0, 4), range(30, 34), range(124, 128), [5, 77, 90]):
        picks = torch.eye(128)[list(columns)]
        assert torch.equal(
            q4_matmul(picks, weight, isa=isa), weight.dequantize()[:, list(columns)].T
        )


@needs_kernel
@each_isa
@pytest.mark.parametrize("rows", [1, 4, 6, 8, 13, 32])
def test_bfloat16_product_is_the_float32_product_rounded(isa: str, rows: int) -> None:
    """bfloat16 inputs are widened exactly and the float32 result rounded once (nearest even):
    the weights are the exact float32 ones, not rounded to bfloat16. Up to the most rows any
    instruction set's layers send the kernel (`Q4_MAX_ROWS_BY_ISA`: 32 bfloat16 rows on an
    AVX2-only CPU), so an AVX-512 machine checks the AVX2 path over its whole range too."""
    _, dequantized = gguf_q4_1(64, 576, seed=rows)
    weight = Q4Weight.recover(dequantized)
    assert weight is not None
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = q4_matmul(x, weight, isa=isa)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 64)
    assert torch.equal(got, q4_matmul(x.float(), weight, isa=isa).bfloat16())
    exact = x.double() @ dequantized.double().T
    summation = 576 * 2**-23 * (x.double().abs() @ dequantized.double().abs().T)
    assert bool(((got.double() - exact).abs() <= exact.abs() * 2**-8 + summation).all())


@needs_kernel
@each_isa
def test_product_keeps_leading_dimensions_and_reads_strided_inputs(isa: str) -> None:
    _, dequantized = gguf_q4_1(40, 64, seed=9)
    weight = Q4Weight.recover(dequantized)
    assert weight is not None
    x = torch.randn(2, 3, 128)[..., ::2]
    got = q4_matmul(x, weight, isa=isa)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, x @ dequantized.T, rtol=1e-5, atol=1e-5)


@needs_kernel
@each_isa
def test_product_does_not_depend_on_the_thread_count(isa: str) -> None:
    """Each output is one thread's fixed-order sum, so 1 and 2 threads give the same bits."""
    _, dequantized = gguf_q4_1(96, 576, seed=5)
    weight = Q4Weight.recover(dequantized)
    assert weight is not None
    x = torch.randn(3, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = q4_matmul(x, weight, isa=isa)
        torch.set_num_threads(2)
        two = q4_matmul(x, weight, isa=isa)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_bad_inputs_raise_before_the_kernel_runs() -> None:
    _, dequantized = gguf_q4_1(8, 64, seed=1)
    weight = Q4Weight.recover(dequantized)
    assert weight is not None
    with pytest.raises(ValueError, match="width"):
        q4_matmul(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        q4_matmul(torch.randn(2, 64).half(), weight)
    with pytest.raises(ValueError, match="instruction set"):
        q4_matmul(torch.randn(2, 64), weight, isa="sse2")  # not one the kernel is built for
