"""GGUF blocks repacked from their raw bytes (`pagedserve_kernels.gguf_panels`) against the gguf
package's own dequantizer (the independent oracle), and multiplied by the int8-activation kernel.

gguf cannot quantize K-quants, so their blocks are random bytes with sane float16 scales:
every code, 6-bit (Q6_K: signed 8-bit) scale and minimum pattern occurs.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedserve_kernels import quant_dot_cpu
from pagedserve_kernels.gguf_panels import form_from_gguf, panels_from_gguf, stack_forms
from tests.kernels.quant_dot_reference import activation_rounding_bound, reference_quantize

T = gguf.GGMLQuantizationType


def random_blocks(kind: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw `kind` blocks `[rows, bytes]` of a `[rows, cols]` matrix."""
    rng = np.random.default_rng(seed)
    if kind in (T.Q4_0, T.Q4_1, T.Q8_0):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        return gguf.quants.quantize(values, kind)
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    halves = rng.uniform(1e-4, 1e-2, (raw.shape[0], 2)).astype(np.float16)
    if kind == T.Q6_K:
        raw[:, -2:] = halves[:, :1].view(np.uint8).reshape(-1, 2)  # d, after the scales
    else:
        raw[:, :4] = halves.view(np.uint8).reshape(-1, 4)  # d and dmin
    return raw.reshape(rows, -1)


K_AND_LEGACY = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("kind", K_AND_LEGACY, ids=lambda k: k.name)
@pytest.mark.parametrize(("rows", "cols"), [(3, 256), (40, 512)])
def test_repacked_blocks_dequantize_as_gguf_does_bit_for_bit(
    kind: gguf.GGMLQuantizationType, rows: int, cols: int
) -> None:
    blocks = random_blocks(kind, rows, cols, seed=rows)
    panels = panels_from_gguf(kind, blocks, (rows, cols))
    expected = gguf.quants.dequantize(blocks, kind).astype(np.float32)
    assert torch.equal(panels.dequantize(), torch.from_numpy(expected))


@pytest.mark.skipif(not quant_dot_cpu.available(), reason="the kernel needs AVX2 and FMA")
@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 19, 130])
def test_k_quant_products_are_within_the_activation_rounding_bound(
    kind: gguf.GGMLQuantizationType, rows: int
) -> None:
    """Against the float32 product over gguf's dequantized weights, and against the kernel's
    own integer arithmetic (per scale group) in float64; every instruction set the same bits."""
    blocks = random_blocks(kind, 48, 512, seed=2)
    panels = panels_from_gguf(kind, blocks, (48, 512))
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, kind).astype(np.float32))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    expected, summation = grouped_reference_product(x, panels)
    results = []
    for isa in quant_dot_cpu.supported_isas():
        got = quant_dot_cpu.quant_matmul(x, panels, isa)
        distance = (got.double() - x.double() @ weight.double().T).abs()
        assert bool((distance <= activation_rounding_bound(x, weight)).all()), isa
        assert bool(((got.double() - expected).abs() <= summation).all()), isa
        results.append(got)
    assert all(torch.equal(results[0], other) for other in results[1:])


def grouped_reference_product(
    x: torch.Tensor, panels: quant_dot_cpu.PanelWeight
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's arithmetic in float64, its float32 summation bound) with scale groups of
    `SCALE_GROUP[bits]`: the int8 activation codes per block of 32, d * sum(codes) per group."""
    group = quant_dot_cpu.SCALE_GROUP[panels.bits]
    codes, scales, mins = panels.unpacked()
    a, d, _ = reference_quantize(x)
    rows, cols = a.shape
    per_group = a.double().view(rows, -1, group)
    d_group = d.double().repeat_interleave(32 // group, dim=1)
    u = codes.double().view(codes.shape[0], -1, group)
    integer = torch.einsum("rgk,ngk->rng", per_group, u)
    scaled = integer * (scales.double()[None] * d_group[:, None, :])
    shifted = mins.double()[None] * (d_group * per_group.sum(-1))[:, None, :]
    terms = scaled.abs().sum(dim=2) + shifted.abs().sum(dim=2)
    bound = (2 * cols // group + 4) * 2**-24 * terms + 1e-30
    return (scaled + shifted).sum(dim=2), bound


def test_formats_without_a_panel_form_and_wrong_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="Q2_K has no 4/8-bit panel form"):
        panels_from_gguf(T.Q2_K, np.zeros((2, 84), dtype=np.uint8), (2, 256))
    with pytest.raises(ValueError, match="do not hold"):
        panels_from_gguf(T.Q4_K, np.zeros((2, 144), dtype=np.uint8), (2, 512))


def test_fused_forms_widen_to_the_narrowest_common_form_or_none() -> None:
    """Row blocks of different formats (a fused qkv of Q4_K q/k and Q6_K v) stack in one form
    that dequantizes to the blocks' weights exactly; 6-bit groups of 16 beside 8-bit codes have
    no common form."""
    parts = [(T.Q4_K, 32), (T.Q5_K, 16), (T.Q6_K, 8)]
    blocks = [random_blocks(kind, rows, 256, seed=rows) for kind, rows in parts]
    forms = [
        form_from_gguf(kind, b, (rows, 256)) for (kind, rows), b in zip(parts, blocks, strict=True)
    ]
    stacked = stack_forms(forms)
    assert stacked is not None and stacked.bits == 6
    expected = np.concatenate(
        [gguf.quants.dequantize(b, kind) for (kind, _), b in zip(parts, blocks, strict=True)]
    )
    assert torch.equal(stacked.panels().dequantize(), torch.from_numpy(expected.astype(np.float32)))
    assert stack_forms(forms[:2]).bits == 5
    q8 = form_from_gguf(T.Q8_0, random_blocks(T.Q8_0, 4, 256, seed=4), (4, 256))
    assert stack_forms([forms[0], q8]).bits == 8
    assert stack_forms([forms[2], q8]) is None


def test_column_slices_fall_on_whole_blocks_of_32() -> None:
    """Row-parallel shards slice columns: any multiple of 32 (not of the 256 super-block)."""
    blocks = random_blocks(T.Q6_K, 8, 512, seed=1)
    form = form_from_gguf(T.Q6_K, blocks, (8, 512))
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, T.Q6_K).astype(np.float32))
    part = form.columns(96, 288)
    assert part is not None
    assert torch.equal(part.panels().dequantize(), weight[:, 96:288])
    assert form.columns(100, 288) is None
    assert torch.equal(form.rows(3, 7).panels().dequantize(), weight[3:7])
