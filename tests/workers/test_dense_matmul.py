"""`DenseMatmul`: the prepacked product equals `F.linear` (bitwise in bfloat16, to float32 rounding
in float32), and falls back where it cannot pack."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.dense_matmul import DenseMatmul, can_pack

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
