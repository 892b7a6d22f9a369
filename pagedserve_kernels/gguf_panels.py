"""GGUF block tensors repacked into `pagedserve_kernels.quant_dot_cpu.PanelWeight` straight from
their raw bytes: Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K and Q6_K.

Each format maps exactly onto the panels' form, unsigned codes with a float32 scale and minimum
per block of 32 (`w = scale * u + min`):

- Q4_0 (`d * (q - 8)`): u = q, scale = d, min = -8 d;
- Q4_1 (`d * q + m`): u = q, scale = d, min = m;
- Q8_0 (`d * q`, q signed): u = q + 128, scale = d, min = -128 d;
- Q4_K / Q5_K (super-blocks of 256, eight sub-blocks of 32 with 6-bit scales and minimums:
  `(d * sc) * q - dmin * m`, q of 4 or 5 bits): u = q, scale = d * sc, min = -(dmin * m), both
  rounded to float32 as the gguf package rounds them (5-bit codes take the panels' byte form);
- Q6_K (super-blocks of 256, sixteen groups of 16 with signed 8-bit scales:
  `(d * sc) * (q - 32)`, q of 6 bits): u = q, scale = d * sc, min = -32 d sc, per group of 16
  (the panels' 6-bit form).

Invariant: `panels_from_gguf(kind, blocks, shape).dequantize()` equals
`gguf.quants.dequantize(blocks, kind)` bit for bit. The other types have no such form and
raise a ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from pagedserve_kernels.quant_dot_cpu import SCALE_GROUP, PanelWeight

SUPER = 256
"""Weights per K-quant super-block."""


@dataclass(frozen=True)
class BlockForm:
    """`[rows, cols]` weights `scale * u + min` before the panel repack: `codes` uint8
    `[rows, cols]` below `2**bits`, `scales` and `mins` float32 `[rows, cols / group]` (group
    `SCALE_GROUP[bits]`). Rows and columns slice, and forms of one width stack, exactly."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bits: int

    @property
    def group(self) -> int:
        return SCALE_GROUP[self.bits]

    def rows(self, start: int, stop: int) -> BlockForm:
        return BlockForm(
            self.codes[start:stop], self.scales[start:stop], self.mins[start:stop], self.bits
        )

    def columns(self, start: int, stop: int) -> BlockForm | None:
        """Columns `[start, stop)`, or None where they do not start and end on whole blocks of
        32 (the kernel's unit)."""
        if start % 32 or stop % 32:
            return None
        group = self.group
        return BlockForm(
            self.codes[:, start:stop],
            self.scales[:, start // group : stop // group],
            self.mins[:, start // group : stop // group],
            self.bits,
        )

    def widened(self, bits: int) -> BlockForm | None:
        """The same weights in the form of `bits`-bit codes (wider codes, and groups of 16 where
        `bits` is 6), or None where that form cannot hold them."""
        if bits == self.bits:
            return self
        if bits < self.bits or (self.bits == 6 and bits == 8):
            return None
        repeat = self.group // SCALE_GROUP[bits]
        scales = self.scales.repeat_interleave(repeat, dim=1)
        return BlockForm(self.codes, scales, self.mins.repeat_interleave(repeat, dim=1), bits)

    def panels(self) -> PanelWeight:
        return PanelWeight.pack(self.codes, self.scales, self.mins, self.bits)


def stack_forms(forms: list[BlockForm]) -> BlockForm | None:
    """Row blocks of one matrix (a fused layer's tensors) in one form: the narrowest that holds
    every block (e.g. Q4_K and Q6_K rows as 6-bit codes), or None where none does (6-bit codes
    in groups of 16 beside 8-bit ones)."""
    bits = max(form.bits for form in forms)
    widened = [form.widened(bits) for form in forms]
    if any(form is None for form in widened):
        return None
    held = [form for form in widened if form is not None]
    return BlockForm(
        torch.cat([form.codes for form in held]),
        torch.cat([form.scales for form in held]),
        torch.cat([form.mins for form in held]),
        bits,
    )


def has_panel_form(kind: gguf.GGMLQuantizationType) -> bool:
    return kind in _DECODERS


def panels_from_gguf(
    kind: gguf.GGMLQuantizationType, blocks: np.ndarray, shape: tuple[int, int]
) -> PanelWeight:
    """The `[rows, cols]` weights stored as GGUF `kind` blocks (`blocks`: uint8, the tensor's
    raw bytes, any shape) in the kernel's layout."""
    return form_from_gguf(kind, blocks, shape).panels()


def form_from_gguf(
    kind: gguf.GGMLQuantizationType, blocks: np.ndarray, shape: tuple[int, int]
) -> BlockForm:
    """The `[rows, cols]` weights stored as GGUF `kind` blocks (see `panels_from_gguf`) as
    codes, scales and minimums."""
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
    return BlockForm(
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
    return codes.reshape(-1, SUPER), scales, mins, 5


def _q6_k(table: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, the float16 d; per half
    # super-block j: weights 64j + 32t + i take nibble t of byte 64j + 32(t % 2) + i (t < 2: low)
    # and bits 2t.. of high byte 32j + i
    low = table[:, 0:128].view(-1, 2, 1, 64)
    low = (low >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F
    high = table[:, 128:192].view(-1, 2, 1, 32)
    high = (high >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 0x03
    codes = low.reshape(-1, SUPER) | (high.reshape(-1, SUPER) << 4)
    scales = _half(table, 208) * table[:, 192:208].view(torch.int8).to(torch.float32)
    return codes, scales, -32.0 * scales, 6


_DECODERS = {
    gguf.GGMLQuantizationType.Q4_0: _q4_0,
    gguf.GGMLQuantizationType.Q4_1: _q4_1,
    gguf.GGMLQuantizationType.Q8_0: _q8_0,
    gguf.GGMLQuantizationType.Q4_K: _q4_k,
    gguf.GGMLQuantizationType.Q5_K: _q5_k,
    gguf.GGMLQuantizationType.Q6_K: _q6_k,
}
"""Per format: raw blocks `[n, type size]` -> (codes `[n, block]`, scales and mins `[n, block /
group]`, code bits; `quant_dot_cpu.SCALE_GROUP`)."""
