"""GGUF block tensors repacked into `kernels.quant_dot_cpu.PanelWeight` straight from their raw
bytes: Q4_0, Q4_1, Q8_0 and the K-quants Q4_K and Q5_K.

Each format maps exactly onto the panels' form, unsigned codes with a float32 scale and minimum
per block of 32 (`w = scale * u + min`):

- Q4_0 (`d * (q - 8)`): u = q, scale = d, min = -8 d;
- Q4_1 (`d * q + m`): u = q, scale = d, min = m;
- Q8_0 (`d * q`, q signed): u = q + 128, scale = d, min = -128 d;
- Q4_K / Q5_K (super-blocks of 256, eight sub-blocks of 32 with 6-bit scales and minimums:
  `(d * sc) * q - dmin * m`, q of 4 or 5 bits): u = q, scale = d * sc, min = -(dmin * m), both
  rounded to float32 as the gguf package rounds them.

Invariant: `panels_from_gguf(kind, blocks, shape).dequantize()` equals
`gguf.quants.dequantize(blocks, kind)` bit for bit. Q6_K (scales per 16 weights) and the other
types have no such form and raise a ValueError.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from kernels.quant_dot_cpu import PanelWeight

SUPER = 256
"""Weights per K-quant super-block."""


def panels_from_gguf(
    kind: gguf.GGMLQuantizationType, blocks: np.ndarray, shape: tuple[int, int]
) -> PanelWeight:
    """The `[rows, cols]` weights stored as GGUF `kind` blocks (`blocks`: uint8, the tensor's
    raw bytes, any shape) in the kernel's layout."""
    rows, cols = shape
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1)
    if cols % block_size or raw.size != rows * cols // block_size * type_size:
        raise ValueError(f"{kind.name} blocks of {raw.size} bytes do not hold a {shape} matrix")
    if kind not in _DECODERS:
        names = ", ".join(k.name for k in _DECODERS)
        raise ValueError(f"{kind.name} has no 4/8-bit panel form (supported: {names})")
    table = torch.from_numpy(raw.reshape(-1, type_size).copy())
    codes, scales, mins, bits = _DECODERS[kind](table)
    return PanelWeight.pack(
        codes.reshape(rows, cols), scales.reshape(rows, -1), mins.reshape(rows, -1), bits
    )


def _half(table: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes [start, start + 2) of every block, as float32 `[blocks, 1]`."""
    return table[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes `[blocks, n]` -> codes `[blocks, 2n]`: the n low nibbles, then the n high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _q4_0(table: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = _half(table, 0)
    return _nibbles(table[:, 2:18]), d, -8.0 * d, 4


def _q4_1(table: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _nibbles(table[:, 4:20]), _half(table, 0), _half(table, 2), 4


def _q8_0(table: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = _half(table, 0)
    codes = (table[:, 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return codes, d, -128.0 * d, 8


def _k_scales(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and minimum float32 `[blocks, 8]` of Q4_K / Q5_K super-blocks (6-bit sc and m
    times the float16 d and dmin)."""
    packed = table[:, 4:16].to(torch.int32)
    low, high, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([low & 63, (mixed & 15) | ((low >> 6) << 4)], dim=1)
    m = torch.cat([high & 63, (mixed >> 4) | ((high >> 6) << 4)], dim=1)
    return _half(table, 0) * sc.to(torch.float32), -(_half(table, 2) * m.to(torch.float32))


def _q4_k(table: torch.Tensor) -> tuple[torch.Tensor, ...]:
    scales, mins = _k_scales(table)
    # four groups of 32 bytes: sub-block 2g in the low nibbles, 2g + 1 in the high ones
    groups = table[:, 16:144].view(-1, 4, 1, 32)
    codes = (groups >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F
    return codes.reshape(-1, SUPER), scales, mins, 4


def _q5_k(table: torch.Tensor) -> tuple[torch.Tensor, ...]:
    scales, mins = _k_scales(table)
    high_bits = table[:, 16:48].view(-1, 1, 32)  # bit j of byte i: sub-block j, weight i
    low = table[:, 48:176].view(-1, 4, 1, 32)
    low = (low >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    high = (high_bits >> shifts) & 1
    codes = low.reshape(-1, 8, 32) | (high << 4)
    return codes.reshape(-1, SUPER), scales, mins, 8


_DECODERS = {
    gguf.GGMLQuantizationType.Q4_0: _q4_0,
    gguf.GGMLQuantizationType.Q4_1: _q4_1,
    gguf.GGMLQuantizationType.Q8_0: _q8_0,
    gguf.GGMLQuantizationType.Q4_K: _q4_k,
    gguf.GGMLQuantizationType.Q5_K: _q5_k,
}
"""Per format: raw blocks `[n, type size]` -> (codes `[n, block]`, scales and mins `[n, block /
32]`, code bits)."""
