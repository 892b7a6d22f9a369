"""Products with int8-quantized activations against 4- and 8-bit block weights on the CPU (the
native kernel in `pagedserve_kernels/csrc/quant_dot_cpu.cpp`), the way llama.cpp multiplies GGUF
weights.

Weights are unsigned codes `u` with a float32 scale and minimum per block of 32 of a row (per
16 for 6-bit codes), `w = scale * u + min`: GGUF's Q4_1 as it is, Q4_0 and Q8_0 with
`min = -8 * scale` and `u = q + 128, min = -128 * scale`, the K-quants as
`pagedserve_kernels.gguf_panels` maps them. `PanelWeight` holds them in the kernel's streamed layout
(columns in panels of 16; see the C++ file), repacked once at load. Activations are quantized
per row and block of 32 to int8 (`d = max|x| / 127`, codes `round(x / d)`), every block's
integer dot product is exact, and the float32 result accumulates
`float(isum) * scale * d + min * d * sum(codes)` over the blocks (scale groups).

Not float32-exact: each activation is rounded to its block's 8-bit grid (an error of at most
`d / 2`), so an output differs from the float32 product over the same weights by at most
`sum over blocks of (d / 2) * sum |w|` plus float32 rounding. `quantize_activations` is
reproduced bit for bit by plain torch, and `quant_matmul` equals that integer arithmetic up to
float32 summation order (tests/kernels/test_quant_dot_cpu.py).

Instruction sets (`ISAS`, chosen at run time, `best_isa()`): AVX-512 VNNI, AVX-512 BW, AVX-VNNI,
AVX2; `available()` is false where the library was not built or the CPU lacks AVX2, and callers
keep their dense product. Any supported set can be asked for by name, so each path runs in
tests on a CPU that has the larger ones.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from pagedserve_kernels.exact_blocks import BLOCK
from pagedserve_kernels.native import FLAG, POINTER, SIZE, NativeLibrary
from pagedserve_kernels.q4_cpu import Q4Weight
from pagedserve_kernels.q8_cpu import Q8Weight

ISAS: dict[str, int] = {"avx512_vnni": 4, "avx512bw": 3, "avx_vnni": 2, "avx2": 1}
"""The kernel's instruction sets by name, fastest first, with the C ABI's numbers."""

PANEL = 16
"""Output columns per panel of the weight layout."""
PANEL_PAIR = 2 * PANEL
"""Columns are padded to whole pairs of panels (an AVX-512 tile's width)."""
BLOCK_BYTES = {4: 256, 5: 512, 6: 512, 8: 512}
"""Code bytes per panel and block of 32, by code width (5-, 6- and 8-bit codes take a byte)."""
SCALE_GROUP = {4: 32, 5: 32, 6: 16, 8: 32}
"""Weights per scale and minimum, by code width (6-bit codes: GGUF Q6_K's groups of 16)."""


@dataclass(frozen=True)
class QuantizedActivations:
    """`[rows, cols]` activations: `codes` int8 `[rows, cols]`, `scales` (d) and `sums`
    (d * sum of a block's codes) float32 `[rows, cols / 32]`."""

    codes: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor


@dataclass(frozen=True)
class PanelWeight:
    """`[rows, cols]` weights `scale * u + min` in the kernel's layout: `codes` uint8 (flat),
    `scales` and `mins` float32 `[panels, cols / group, 16]` (flat; group `SCALE_GROUP[bits]`),
    `bits` 4, 5, 6 or 8 (codes below `2**bits`). Columns past `rows` (the padding to whole panel
    pairs) have code, scale and minimum 0."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bits: int
    rows: int
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @staticmethod
    def pack(
        codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int
    ) -> PanelWeight:
        """The layout of unsigned `codes` `[rows, cols]` (values below 2**bits) with `scales` and
        `mins` `[rows, cols / SCALE_GROUP[bits]]`."""
        if bits not in BLOCK_BYTES:
            raise ValueError(f"PanelWeight takes 4-, 5-, 6- or 8-bit codes, got {bits}")
        rows, cols = codes.shape
        groups = cols // SCALE_GROUP[bits]
        if cols % BLOCK or scales.shape != (rows, groups) or mins.shape != scales.shape:
            raise ValueError(f"PanelWeight: codes {tuple(codes.shape)} and scales do not match")
        if codes.numel() and int(codes.max()) >= 1 << bits:
            raise ValueError(f"PanelWeight: codes of {bits} bits must be below {1 << bits}")
        padded = -(-rows // PANEL_PAIR) * PANEL_PAIR
        blocks = cols // BLOCK
        u = torch.zeros(padded, cols, dtype=torch.uint8)
        u[:rows] = codes
        # [panel, column, block, k]: k = 4 * step + byte for bytes; 16 * half + 4 * chunk + byte
        u = u.view(padded // PANEL, PANEL, blocks, BLOCK)
        if bits != 4:
            streamed = u.view(-1, PANEL, blocks, 8, 4).permute(0, 2, 3, 1, 4)
        else:
            halves = u.view(-1, PANEL, blocks, 2, 4, 4)
            nibbles = halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)
            streamed = nibbles.permute(0, 2, 3, 1, 4)
        return PanelWeight(
            streamed.contiguous().view(-1),
            _panel_floats(scales, padded),
            _panel_floats(mins, padded),
            bits,
            rows,
            cols,
        )

    @staticmethod
    def from_q4(weight: Q4Weight) -> PanelWeight:
        """GGUF Q4_1 blocks (`pagedserve_kernels.q4_cpu`): the same codes, scales and minimums.
        GGUF's byte i of a block holds codes i and i + 16, which is the layout's byte order within a
        chunk, so the repack only moves whole bytes."""
        rows, cols = weight.shape
        padded = -(-rows // PANEL_PAIR) * PANEL_PAIR
        blocks = cols // BLOCK
        nibbles = torch.zeros(padded, cols // 2, dtype=torch.uint8)
        nibbles[:rows] = weight.codes
        # [panel, column, block, chunk, byte] -> [panel, block, chunk, column, byte]
        streamed = nibbles.view(-1, PANEL, blocks, 4, 4).permute(0, 2, 3, 1, 4)
        return PanelWeight(
            streamed.contiguous().view(-1),
            _panel_floats(weight.scales, padded),
            _panel_floats(weight.mins, padded),
            4,
            rows,
            cols,
        )

    @staticmethod
    def from_q8(weight: Q8Weight) -> PanelWeight:
        """GGUF Q8_0 blocks (`pagedserve_kernels.q8_cpu`): codes q + 128, minimums -128 * scale
        (exact)."""
        codes = (weight.codes.to(torch.int16) + 128).to(torch.uint8)
        return PanelWeight.pack(codes, weight.scales, -128.0 * weight.scales, 8)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes uint8, scales, mins) `[rows, cols]` / `[rows, cols / 32]`, as `pack` took them."""
        blocks, groups = self.cols // BLOCK, self.cols // SCALE_GROUP[self.bits]
        panels = self.scales.numel() // (groups * PANEL)
        if self.bits != 4:
            streamed = self.codes.view(panels, blocks, 8, PANEL, 4).permute(0, 3, 1, 2, 4)
            codes = streamed.reshape(panels * PANEL, self.cols)
        else:
            nibbles = self.codes.view(panels, blocks, 4, PANEL, 4).permute(0, 3, 1, 2, 4)
            codes = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=3)
            codes = codes.reshape(panels * PANEL, self.cols)
        scales = self.scales.view(panels, groups, PANEL).permute(0, 2, 1).reshape(-1, groups)
        mins = self.mins.view(panels, groups, PANEL).permute(0, 2, 1).reshape(-1, groups)
        return codes[: self.rows], scales[: self.rows], mins[: self.rows]

    def dequantize(self) -> torch.Tensor:
        """The float32 weights `scale * u + min`, rounded once (computed in float64, where
        `scale * u + min` of float32 scales and minimums is exact or rounds as float32 would)."""
        codes, scales, mins = self.unpacked()
        grouped = codes.view(self.rows, -1, SCALE_GROUP[self.bits]).to(torch.float64)
        weights = grouped * scales.double()[:, :, None] + mins.double()[:, :, None]
        return weights.to(torch.float32).reshape(self.rows, self.cols)


def _panel_floats(values: torch.Tensor, padded: int) -> torch.Tensor:
    """`[rows, groups]` float32 values as `[panels, groups, 16]` (flat), zero-padded rows."""
    rows, groups = values.shape
    full = torch.zeros(padded, groups, dtype=torch.float32)
    full[:rows] = values
    return full.view(padded // PANEL, PANEL, groups).permute(0, 2, 1).contiguous().view(-1)


@functools.cache
def _native() -> NativeLibrary:
    """The kernel library as this process loaded it (`pagedserve_kernels.native.NativeLibrary`)."""
    quantize = [POINTER, FLAG, SIZE, SIZE, POINTER, POINTER, POINTER]
    matmul = [FLAG, POINTER, FLAG, SIZE, SIZE, POINTER, FLAG, POINTER, POINTER, SIZE, POINTER]
    matmul += [FLAG]
    signatures = {"quant_dot_quantize": quantize, "quant_dot_matmul": matmul}
    return NativeLibrary.load(
        "pagedserve_kernels._quant_dot_cpu",
        "quant_dot_supported",
        signatures,
        "quant_dot_isa_supported",
        ISAS,
    )


def available() -> bool:
    """Whether the native kernel was built and this CPU runs it (AVX2 and FMA at least)."""
    return _native().available()


def supported_isas() -> tuple[str, ...]:
    """The instruction sets of `ISAS` this CPU runs the kernel with, fastest first."""
    return _native().isas


def best_isa() -> str | None:
    """The fastest instruction set this CPU runs the kernel with (None: none)."""
    return _native().best_isa()


def isa_number(isa: str | None) -> int:
    """The C ABI number of `isa` (None: the fastest), as `quant_dot_matmul` and the decoder
    stack take it; ValueError where this CPU does not run the kernel with it."""
    return _native().isa_number(isa)


def _checked(x: torch.Tensor, cols: int) -> tuple[ctypes.CDLL, torch.Tensor]:
    library = _native().require("the quant_dot CPU kernel is not available (not built, or no AVX2)")
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"quant_dot takes float32 or bfloat16 CPU inputs, got {x.dtype}")
    if x.shape[-1] != cols or cols % BLOCK:
        raise ValueError(f"quant_dot: input width {x.shape[-1]} != {cols} or not whole blocks")
    return library, x.reshape(-1, cols).contiguous()


def _scratch(rows: int, cols: int) -> QuantizedActivations:
    blocks = cols // BLOCK
    return QuantizedActivations(
        torch.empty(rows, cols, dtype=torch.int8),
        torch.empty(rows, blocks, dtype=torch.float32),
        torch.empty(rows, blocks, dtype=torch.float32),
    )


def quantize_activations(x: torch.Tensor) -> QuantizedActivations:
    """`x [rows, K]` (float32 or bfloat16) quantized per row-block of 32 as the kernel does."""
    library, flat = _checked(x, x.shape[-1])
    rows, cols = flat.shape
    out = _scratch(rows, cols)
    status = library.quant_dot_quantize(
        flat.data_ptr(),
        int(flat.dtype == torch.bfloat16),
        rows,
        cols,
        out.codes.data_ptr(),
        out.scales.data_ptr(),
        out.sums.data_ptr(),
    )
    if status != 0:
        raise RuntimeError(f"quant_dot_quantize failed with status {status}")
    return out


def quant_matmul(x: torch.Tensor, weight: PanelWeight, isa: str | None = None) -> torch.Tensor:
    """`x [..., K] @ W^T` with `x` quantized per row-block of 32, in `x`'s dtype (float32, or
    bfloat16 rounded once from the float32 result); `isa`: one of `supported_isas()` (None:
    the fastest)."""
    library, flat = _checked(x, weight.cols)
    number = _native().isa_number(isa)
    rows = flat.shape[0]
    out = torch.empty(rows, weight.rows, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    status = library.quant_dot_matmul(
        number,
        flat.data_ptr(),
        bf16,
        rows,
        weight.cols,
        weight.codes.data_ptr(),
        weight.bits,
        weight.scales.data_ptr(),
        weight.mins.data_ptr(),
        weight.rows,
        out.data_ptr(),
        bf16,
    )
    if status != 0:
        raise RuntimeError(f"quant_dot_matmul failed with status {status}")
    return out.reshape(*x.shape[:-1], weight.rows)
