"""4-bit weights with a float32 scale and minimum per block of 32 (GGUF's Q4_1), multiplied on
the CPU by the small native kernel in `pagedserve_kernels/csrc/q4_cpu.cpp`.

A weight row of K values is K / 32 blocks; block b holds codes q in 0..15 and the weights are
`scale[b] * q + min[b]`. `Q4Weight.recover` finds that form in a float32 matrix when it is there
exactly (a matrix dequantized from Q4_1, whose blocks contain q = 0 and q = 15 by construction),
and `Q4Weight.dequantize` is the plain-torch oracle. `q4_matmul(x, weight)` reads 0.75 bytes per
weight (0.5 of codes, 0.25 of float32 scales and minimums) instead of 2 (bfloat16) or 4: for
decode batches, where the product is bound by reading the weights, it beats the packed dense
products (benchmarks/linear_kernels.py).

Invariants: `recover` returns a `Q4Weight` only if its `dequantize()` equals the given matrix
bit for bit, else None; `q4_matmul` equals `x.float() @ weight.dequantize().T` up to float32
summation order, in `x`'s dtype (float32, or bfloat16 rounded to nearest even), with every
instruction set. The kernel is built by pip at install time for AVX-512 and for AVX2 with FMA
(`supported_isas()`, fastest first; `q4_matmul(..., isa=)` forces one, so tests run each this
CPU has); `available()` is false where it was not built or the CPU lacks AVX2 and FMA, and
callers then keep their dense product.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedserve_kernels.exact_blocks import BLOCK, solve_exact_blocks
from pagedserve_kernels.native import FLAG, POINTER, SIZE, NativeLibrary

CODE_MAX = 15


@dataclass(frozen=True)
class Q4Weight:
    """`[rows, cols]` weights: `codes` `[rows, cols / 2]` uint8 (byte j of a block holds code j
    in its low nibble and code j + 16 in its high nibble, GGUF's order), `scales` and `mins`
    `[rows, cols / 32]` float32; all contiguous CPU tensors."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1] * 2)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights, `scale * q + min` rounded once, as GGUF's dequantizer does."""
        rows, cols = self.shape
        low = (self.codes & 0x0F).view(rows, cols // BLOCK, BLOCK // 2)
        high = (self.codes >> 4).view(rows, cols // BLOCK, BLOCK // 2)
        codes = torch.cat([low, high], dim=2).to(torch.float32)
        weights = codes * self.scales[:, :, None] + self.mins[:, :, None]
        return weights.reshape(rows, cols)

    @staticmethod
    def from_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Q4Weight:
        """The weights `scales * codes + mins` given as one uint8 code (below 16) per weight
        `[rows, cols]` and float32 `scales` / `mins` `[rows, cols / 32]` (a GGUF K-quant's
        block form, `pagedserve_kernels.gguf_panels.BlockForm`). Exact as the kernel computes it
        where every `scale * code` is exact in float32 (scales of at most 20 significant bits:
        Q4_K's float16 `d` times a 6-bit sub-scale)."""
        rows, cols = codes.shape
        blocks = codes.reshape(rows, cols // BLOCK, BLOCK)
        packed = blocks[:, :, : BLOCK // 2] | (blocks[:, :, BLOCK // 2 :] << 4)
        return Q4Weight(
            packed.reshape(rows, cols // 2).contiguous(),
            scales.to(torch.float32).contiguous(),
            mins.to(torch.float32).contiguous(),
        )

    @staticmethod
    def recover(weight: torch.Tensor) -> Q4Weight | None:
        """The exact block form of a float32 matrix, or None where it has none.

        Per block the minimum is the block's smallest weight (code 0) and the scale is
        `(max - min) / 15` rounded to float16, as Q4_1 stores it (or a float16 neighbour,
        whichever reproduces the block); the codes are then the rounded quotients. Scales are
        float16 values, so `scale * q` is exact in float32 and the kernel's fused multiply-add
        rounds each weight exactly as `dequantize` does.
        The first row is tried alone first, so a matrix of another form costs one row.
        """
        solved = solve_exact_blocks(weight, _solve_blocks)
        if solved is None:
            return None
        codes, scales, mins = solved
        rows, cols = weight.shape
        packed = codes[:, :, : BLOCK // 2] | (codes[:, :, BLOCK // 2 :] << 4)
        return Q4Weight(packed.reshape(rows, cols // 2).contiguous(), scales, mins)


def _solve_blocks(
    blocks: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes uint8, scales, mins) with `scale * code + min == block` bit for bit for every
    block of `blocks [rows, n, 32]` (float32), or None if some block has no such form."""
    if not bool(torch.isfinite(blocks).all()):
        return None
    mins = blocks.amin(dim=2)
    spans = blocks.amax(dim=2) - mins
    nearest = (spans / CODE_MAX).to(torch.float16)
    candidates = [
        nearest.to(torch.float32),
        torch.nextafter(nearest, torch.full_like(nearest, float("inf"))).to(torch.float32),
        torch.nextafter(nearest, torch.zeros_like(nearest)).to(torch.float32),
    ]
    offsets = blocks - mins[:, :, None]
    scales = torch.zeros_like(mins)
    codes = torch.zeros(blocks.shape, dtype=torch.uint8)
    solved = spans == 0  # constant blocks: code 0, scale 0
    for candidate in candidates:
        divisor = torch.where(candidate > 0, candidate, torch.ones_like(candidate))
        trial = (offsets / divisor[:, :, None]).round_().clamp_(0, CODE_MAX)
        exact = (trial * candidate[:, :, None] + mins[:, :, None] == blocks).all(dim=2)
        exact &= ~solved & (candidate > 0)
        scales = torch.where(exact, candidate, scales)
        codes = torch.where(exact[:, :, None], trial.to(torch.uint8), codes)
        solved |= exact
        if bool(solved.all()):
            return codes, scales, mins.contiguous()
    return None


@functools.cache
def _native() -> NativeLibrary:
    """The kernel library as this process loaded it (`pagedserve_kernels.native.NativeLibrary`)."""
    matmul = [FLAG, POINTER, FLAG, POINTER, SIZE, SIZE, POINTER, POINTER, POINTER, SIZE, POINTER]
    matmul += [FLAG]
    return NativeLibrary.load(
        "pagedserve_kernels._q4_cpu", "q4_supported", {"q4_matmul": matmul}, "q4_isa_supported"
    )


def available() -> bool:
    """Whether the native kernel was built and this CPU runs it (AVX2 and FMA at least)."""
    return _native().available()


def supported_isas() -> tuple[str, ...]:
    """The instruction sets (`pagedserve_kernels.native.VECTOR_ISAS`) this CPU runs the kernel with,
    fastest first."""
    return _native().isas


def best_isa() -> str | None:
    """The fastest instruction set this CPU runs the kernel with (None: none)."""
    return _native().best_isa()


def q4_matmul(x: torch.Tensor, weight: Q4Weight, isa: str | None = None) -> torch.Tensor:
    """`x [..., K] @ W^T` for a `Q4Weight` W `[N, K]` over its exact float32 weights, in `x`'s
    dtype: float32, or bfloat16 (widened exactly, the float32 result rounded once); `isa`: one
    of `supported_isas()` (None: the fastest)."""
    library = _native().require(
        "the q4 CPU kernel is not available (not built, or no AVX2 and FMA)"
    )
    rows_out, cols = weight.shape
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"q4_matmul takes float32 or bfloat16 CPU inputs, got {x.dtype}")
    if x.shape[-1] != cols:
        raise ValueError(f"q4_matmul: input width {x.shape[-1]} != weight width {cols}")
    flat = x.reshape(-1, cols).contiguous()
    rows = flat.shape[0]
    out = torch.empty(rows, rows_out, dtype=x.dtype)
    bf16 = x.dtype == torch.bfloat16
    widened = torch.empty(rows * cols if bf16 else 0, dtype=torch.float32)
    status = library.q4_matmul(
        _native().isa_number(isa),
        flat.data_ptr(),
        int(bf16),
        widened.data_ptr(),
        rows,
        cols,
        weight.codes.data_ptr(),
        weight.scales.data_ptr(),
        weight.mins.data_ptr(),
        rows_out,
        out.data_ptr(),
        int(bf16),
    )
    if status != 0:
        raise RuntimeError(f"q4_matmul failed with status {status}")
    return out.reshape(*x.shape[:-1], rows_out)
