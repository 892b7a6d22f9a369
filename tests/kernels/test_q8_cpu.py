"""The CPU 8-bit kernel (`pagedserve_kernels.q8_cpu`) against plain torch: the exact recovery of
GGUF Q8_0 blocks (quantized by the gguf package) from dequantized float32 weights, and products
equal to float32 (float64 as the oracle) over the dequantized weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedserve_kernels import q8_cpu
from pagedserve_kernels.q8_cpu import Q8Weight, q8_matmul
from tests.kernels.cpu_features import (
    cpu_has_avx2_fma,
    cpu_vector_isas,
    each_isa,
    needs_vector_kernels,
)
from tests.kernels.gguf_blocks import gguf_blocks, within_float32_summation

needs_kernel = needs_vector_kernels


def gguf_q8_0(rows: int, cols: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    return gguf_blocks(gguf.GGMLQuantizationType.Q8_0, rows, cols, seed)


def test_kernel_is_built_wherever_the_cpu_runs_it() -> None:
    assert q8_cpu.available() == cpu_has_avx2_fma()
    assert q8_cpu.supported_isas() == cpu_vector_isas()


@pytest.mark.parametrize(("rows", "cols"), [(1, 32), (7, 96), (96, 576), (130, 1536)])
def test_recover_finds_gguf_q8_0_blocks_exactly(rows: int, cols: int) -> None:
    blocks, dequantized = gguf_q8_0(rows, cols, seed=rows)
    recovered = Q8Weight.recover(dequantized)
    assert recovered is not None and recovered.shape == (rows, cols)
    assert torch.equal(recovered.dequantize(), dequantized)
    # the same codes and scales the file holds: per block an fp16 d, then 32 int8 codes
    raw = blocks.reshape(rows, cols // 32, 34)
    scales = raw[:, :, 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    codes = raw[:, :, 2:].copy().view(np.int8).reshape(rows, cols)
    assert torch.equal(recovered.scales, torch.from_numpy(scales))
    assert torch.equal(recovered.codes, torch.from_numpy(codes))


def test_recover_handles_zero_blocks() -> None:
    weight = torch.zeros(2, 64)
    codes = torch.arange(32) - 16
    codes[0] = -127  # the block's largest magnitude sets its scale: 0.25
    weight[1, 32:] = codes * 0.25
    recovered = Q8Weight.recover(weight)
    assert recovered is not None and torch.equal(recovered.dequantize(), weight)


@pytest.mark.parametrize(
    "weight",
    [
        torch.randn(8, 64),  # dense float32 weights: no 8-bit form
        torch.randn(8, 48),  # width not a multiple of 32
        torch.randn(8, 64).bfloat16(),  # not float32
        torch.full((2, 32), float("inf")),
    ],
    ids=["random", "width", "dtype", "inf"],
)
def test_recover_refuses_what_has_no_exact_8_bit_form(weight: torch.Tensor) -> None:
    assert Q8Weight.recover(weight) is None


def test_recover_refuses_a_matrix_exact_only_in_its_first_row() -> None:
    _, dequantized = gguf_q8_0(4, 64, seed=3)
    dequantized[2, 5] += 1e-3
    assert Q8Weight.recover(dequantized) is None


@needs_kernel
@each_isa
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 32), (6, 64), (7, 96), (130, 576)])
def test_product_equals_float32_matmul_over_the_dequantized_weights(
    isa: str, rows: int, out_features: int, in_features: int
) -> None:
    _, dequantized = gguf_q8_0(out_features, in_features, seed=out_features + rows)
    weight = Q8Weight.recover(dequantized)
    assert weight is not None
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    got = q8_matmul(x, weight, isa=isa)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert within_float32_summation(got, x, dequantized)


@needs_kernel
@each_isa
def test_kernel_reads_each_weight_exactly_as_dequantize_gives_it(isa: str) -> None:
    """One-hot rows pick single weights out of the product: every weight bit for bit."""
    _, dequantized = gguf_q8_0(50, 128, seed=4)
    weight = Q8Weight.recover(dequantized)
    assert weight is not None
    for columns in (range(0, 4), range(30, 34), range(124, 128), [5, 77, 90]):
        picks = torch.eye(128)[list(columns)]
        assert torch.equal(
            q8_matmul(picks, weight, isa=isa), weight.dequantize()[:, list(columns)].T
        )


@needs_kernel
@each_isa
def test_product_does_not_depend_on_the_thread_count_or_the_other_rows(isa: str) -> None:
    _, dequantized = gguf_q8_0(97, 576, seed=5)
    weight = Q8Weight.recover(dequantized)
    assert weight is not None
    x = torch.randn(6, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = q8_matmul(x, weight, isa=isa)
        torch.set_num_threads(2)
        two = q8_matmul(x, weight, isa=isa)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.equal(q8_matmul(x[4:5], weight, isa=isa), one[4:5])


@needs_kernel
def test_bad_inputs_raise_before_the_kernel_runs() -> None:
    _, dequantized = gguf_q8_0(8, 64, seed=1)
    weight = Q8Weight.recover(dequantized)
    assert weight is not None
    with pytest.raises(ValueError, match="width"):
        q8_matmul(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="float32"):
        q8_matmul(torch.randn(2, 64).bfloat16(), weight)
    with pytest.raises(ValueError, match="2-d"):
        q8_matmul(torch.randn(2, 1, 64), weight)
