"""Random matrices quantized by the gguf package (the independent oracle of the block formats),
and the float32 summation bound the native products are held to."""

from __future__ import annotations

import gguf
import numpy as np
import torch


def gguf_blocks(
    kind: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int
) -> tuple[np.ndarray, torch.Tensor]:
    """(GGUF blocks of `kind`, their float32 dequantization) of a random matrix whose rows have
    scales from 0.01 to 3."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    values *= np.random.default_rng(seed + 1).uniform(0.01, 3.0, (rows, 1)).astype(np.float32)
    blocks = gguf.quants.quantize(values, kind)
    dequantized = gguf.quants.dequantize(blocks, kind)
    return blocks, torch.from_numpy(np.ascontiguousarray(dequantized, dtype=np.float32))


def within_float32_summation(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `got` equals `x @ weight.T` up to float32 summation: an error below
    K * eps * sum |x||w| per output (float64 as the oracle)."""
    exact = x.double() @ weight.double().T
    bound = x.shape[-1] * 2**-23 * (x.double().abs() @ weight.double().abs().T)
    return bool(((got.double() - exact).abs() <= bound).all())
