"""GGUF blocks repacked from their raw bytes (`kernels.gguf_panels`) against the gguf package's
own dequantizer (the independent oracle), and multiplied by the int8-activation kernel.

gguf cannot quantize K-quants, so their blocks are random bytes with sane float16 scales:
every code, 6-bit scale and minimum pattern occurs.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels import quant_dot_cpu
from kernels.gguf_panels import panels_from_gguf
from tests.kernels.quant_dot_reference import activation_rounding_bound

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
    raw[:, :4] = halves.view(np.uint8).reshape(-1, 4)  # d and dmin
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K], ids=lambda k: k.name)
@pytest.mark.parametrize(("rows", "cols"), [(3, 256), (40, 512)])
def test_repacked_blocks_dequantize_as_gguf_does_bit_for_bit(
    kind: gguf.GGMLQuantizationType, rows: int, cols: int
) -> None:
    blocks = random_blocks(kind, rows, cols, seed=rows)
    panels = panels_from_gguf(kind, blocks, (rows, cols))
    expected = gguf.quants.dequantize(blocks, kind).astype(np.float32)
    assert torch.equal(panels.dequantize(), torch.from_numpy(expected))


@pytest.mark.skipif(not quant_dot_cpu.available(), reason="the kernel needs AVX2 and FMA")
@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_K, T.Q5_K], ids=lambda k: k.name)
def test_k_quant_products_are_within_the_activation_rounding_bound(
    kind: gguf.GGMLQuantizationType,
) -> None:
    blocks = random_blocks(kind, 48, 512, seed=2)
    panels = panels_from_gguf(kind, blocks, (48, 512))
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, kind).astype(np.float32))
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(2))
    for isa in quant_dot_cpu.supported_isas():
        distance = (
            quant_dot_cpu.quant_matmul(x, panels, isa).double() - x.double() @ weight.double().T
        ).abs()
        assert bool((distance <= activation_rounding_bound(x, weight)).all()), isa


def test_formats_without_a_panel_form_and_wrong_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="Q6_K has no 4/8-bit panel form"):
        panels_from_gguf(T.Q6_K, np.zeros((2, 210), dtype=np.uint8), (2, 256))
    with pytest.raises(ValueError, match="do not hold"):
        panels_from_gguf(T.Q4_K, np.zeros((2, 144), dtype=np.uint8), (2, 512))
