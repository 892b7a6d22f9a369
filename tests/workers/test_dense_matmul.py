"""`DenseMatmul`: the prepacked product equals `F.linear` (bitwise in bfloat16, to float32 rounding
in float32), and falls back where it cannot pack; decode-sized calls on a Q4_1 layer take its
4-bit copy and compute the same product."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve_kernels import q4_cpu
from workers.dense_matmul import Q4_MAX_ROWS, DenseMatmul, can_pack

needs_packing = pytest.mark.skipif(
    not can_pack(torch.zeros(2, 2, dtype=torch.bfloat16)),
    reason="this torch build has no oneDNN bfloat16 linear",
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_product_equals_f_linear(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(rows, 80, generator=generator).bfloat16()
    matmul = DenseMatmul(weight)
    matmul.pack()
    assert matmul.packed is not None
    torch.testing.assert_close(matmul(x, bias), F.linear(x, weight, bias), rtol=0, atol=0)
    strided = torch.randn(rows, 160, generator=generator).bfloat16()[:, ::2]
    torch.testing.assert_close(matmul(strided), F.linear(strided, weight), rtol=0, atol=0)


@needs_packing
def test_pack_snapshots_the_weight_until_packed_again() -> None:
    weight = torch.ones(8, 8, dtype=torch.bfloat16)
    matmul = DenseMatmul(weight)
    matmul.pack()
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    weight.mul_(2)
    assert float(matmul(x)[0, 0]) == 8.0  # the snapshot
    matmul.pack()
    assert float(matmul(x)[0, 0]) == 16.0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_packed_float32_product_matches_f_linear(rows: int) -> None:
    """float32 weights are packed too (oneDNN's float32 kernel): equal to float32 rounding."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator)
    bias = torch.randn(96, generator=generator)
    x = torch.randn(rows, 80, generator=generator)
    matmul = DenseMatmul(weight)
    matmul.pack()
    assert matmul.packed is not None
    got = matmul(x, bias)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_take_f_linear_where_onednn_has_no_bfloat16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As on an AVX2-only CPU (oneDNN without bfloat16 kernels), forced here on any CPU: the
    weight stays unpacked and the product is `F.linear`'s, bit for bit."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    weight = torch.randn(12, 64).bfloat16()
    assert not can_pack(weight)
    assert can_pack(weight.float())
    matmul = DenseMatmul(weight)
    matmul.pack()
    assert matmul.packed is None
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(matmul(x), F.linear(x, weight))


def test_float16_weights_take_f_linear() -> None:
    weight = torch.randn(12, 10).half()
    matmul = DenseMatmul(weight)
    matmul.pack()
    assert matmul.packed is None
    x = torch.randn(3, 10).half()
    assert torch.equal(matmul(x), F.linear(x, weight))


@needs_packing
def test_float32_input_on_a_packed_bfloat16_weight_is_rejected_like_f_linear() -> None:
    weight = torch.randn(12, 10).bfloat16()
    matmul = DenseMatmul(weight)
    matmul.pack()
    with pytest.raises(RuntimeError):
        F.linear(torch.randn(3, 10), weight)
    with pytest.raises(RuntimeError):
        matmul(torch.randn(3, 10))


def q4_1_weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """float32 weights dequantized from GGUF Q4_1 blocks (what a Q4_1 checkpoint loads as)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=generator).numpy()
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_1)
    dequantized = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)
    return torch.from_numpy(np.ascontiguousarray(dequantized, dtype=np.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_take_the_4_bit_copy_and_compute_the_same_product(dtype: torch.dtype) -> None:
    source = q4_1_weights(72, 96, seed=1)
    weight = source.to(dtype)
    bias = torch.randn(72).to(dtype)
    matmul = DenseMatmul(weight)
    matmul.adopt_exact_source(source)
    matmul.pack()
    assert (matmul.q4 is not None) == q4_cpu.available()
    if matmul.q4 is None:
        return  # no kernel on this CPU: the packed product alone (the tests above)
    limit = Q4_MAX_ROWS[dtype]
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
        got = matmul(x, bias)
        assert got.dtype == dtype
        if rows <= limit:  # the checkpoint's exact weights, float32 sums, then the bias
            exact = F.linear(x.double(), source.double(), bias.double())
            magnitude = F.linear(x.double().abs(), source.double().abs(), bias.double().abs())
            # bfloat16: the product and the bias sum are each rounded once (2^-9 each)
            rounding = 2**-23 if dtype == torch.float32 else 2**-8
            bound = (96 * 2**-23 + rounding) * magnitude
            assert bool(((got.double() - exact).abs() <= bound).all())
        elif dtype == torch.bfloat16:  # the packed weight, as F.linear computes it
            assert torch.equal(got, F.linear(x, weight, bias))
        else:
            torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_a_weight_changed_after_loading_drops_its_4_bit_copy() -> None:
    source = q4_1_weights(8, 64, seed=2)
    matmul = DenseMatmul(source.clone())
    matmul.adopt_exact_source(source)
    matmul.pack()
    if not q4_cpu.available():
        assert matmul.q4 is None
        return
    assert matmul.q4 is not None
    matmul.weight.mul_(2)
    matmul.pack()
    assert matmul.q4 is None
    x = torch.randn(1, 64)
    torch.testing.assert_close(matmul(x), F.linear(x, matmul.weight), rtol=1e-5, atol=1e-5)


def test_no_4_bit_copy_for_other_weights_or_when_switched_off() -> None:
    dense = torch.randn(8, 64)
    matmul = DenseMatmul(dense)
    matmul.adopt_exact_source(dense)
    assert matmul.q4 is None  # not Q4_1 blocks
    source = q4_1_weights(8, 64, seed=3)
    switched_off = DenseMatmul(source.clone())
    switched_off.quantized_decode = False
    switched_off.adopt_exact_source(source)
    assert switched_off.q4 is None
    half = DenseMatmul(source.half())
    half.adopt_exact_source(source)
    assert half.q4 is None  # no float16 path
