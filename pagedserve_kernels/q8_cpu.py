"""8-bit weights with a float32 scale per block of 32 (GGUF's Q8_0), multiplied on the CPU by
the small native kernel in `pagedserve_kernels/csrc/q8_cpu.cpp`: the LM head of a model whose
checkpoint stores it as Q8_0 (the default model's tied embedding), for decode-sized batches.

A weight row of K values is K / 32 blocks; block b holds codes q in -128..127 and the weights
are `scale[b] * q`, the scale a float16 value. `Q8Weight.recover` finds that form in a float32
matrix when it is there exactly, and `Q8Weight.dequantize` is the plain-torch oracle.
`q8_matmul(x, weight)` reads 1.125 bytes per weight instead of 2 (bfloat16) or 4 (float32).

Invariants: `recover` returns a `Q8Weight` only if its `dequantize()` equals the given matrix bit
for bit, else None; `q8_matmul` equals `x @ weight.dequantize().T` in float32 up to the order of
float32 summation (each weight is exact: float16 scale times an 8-bit code). The kernel is built
by pip at install time for AVX-512 and for AVX2 with FMA (`supported_isas()`, fastest first;
`q8_matmul(..., isa=)` forces one, so tests run each this CPU has); `available()` is false where
it was not built or the CPU lacks AVX2 and FMA, and callers then keep their dense product.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedserve_kernels.exact_blocks import BLOCK, solve_exact_blocks
from pagedserve_kernels.native import FLAG, POINTER, SIZE, NativeLibrary

CODE_MAX = 127
"""Q8_0 codes are `round(w / scale)` with `scale = max|w| / 127`, so they span -127..127."""


@dataclass(frozen=True)
class Q8Weight:
    """`[rows, cols]` weights: `codes` `[rows, cols]` int8 and `scales` `[rows, cols / 32]`
    float32 (float16 values); contiguous CPU tensors."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weights `scale * q` (exact in float32)."""
        rows, cols = self.shape
        blocks = self.codes.view(rows, cols // BLOCK, BLOCK).to(torch.float32)
        return (blocks * self.scales[:, :, None]).reshape(rows, cols)

    @staticmethod
    def recover(weight: torch.Tensor) -> Q8Weight | None:
        """The exact block form of a float32 matrix, or None where it has none.

        Per block the scale is `max|w| / 127` rounded to float16, as Q8_0 stores it (or a
        float16 neighbour, whichever reproduces the block); the codes are the rounded quotients.
        The first row is tried alone first, so a matrix of another form costs one row."""
        solved = solve_exact_blocks(weight, _solve_blocks)
        if solved is None:
            return None
        codes, scales = solved
        return Q8Weight(codes.reshape(weight.shape).contiguous(), scales.contiguous())


def _solve_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes int8, scales) with `scale * code == block` bit for bit for every block of
    `blocks [rows, n, 32]` (float32), or None if some block has no such form."""
    if not bool(torch.isfinite(blocks).all()):
        return None
    nearest = (blocks.abs().amax(dim=2) / CODE_MAX).to(torch.float16)
    candidates = [
        nearest,
        torch.nextafter(nearest, torch.full_like(nearest, float("inf"))),
        torch.nextafter(nearest, torch.zeros_like(nearest)),
    ]
    scales = torch.zeros(blocks.shape[:2], dtype=torch.float32)
    codes = torch.zeros(blocks.shape, dtype=torch.int8)
    solved = (blocks == 0).all(dim=2)  # zero blocks: code 0, scale 0
    for candidate in (c.to(torch.float32) for c in candidates):
        divisor = torch.where(candidate > 0, candidate, torch.ones_like(candidate))
        trial = (blocks / divisor[:, :, None]).round_().clamp_(-128, CODE_MAX)
        exact = (trial * candidate[:, :, None] == blocks).all(dim=2)
        exact &= ~solved & (candidate > 0)
        scales = torch.where(exact, candidate, scales)
        codes = torch.where(exact[:, :, None], trial.to(torch.int8), codes)
        solved |= exact
        if bool(solved.all()):
            return codes, scales
    return None


@functools.cache
def _native() -> NativeLibrary:
    """The kernel library as this process loaded it (`pagedserve_kernels.native.NativeLibrary`)."""
    matmul = [FLAG, POINTER, SIZE, SIZE, POINTER, POINTER, SIZE, POINTER]
    return NativeLibrary.load(
        "pagedserve_kernels._q8_cpu", "q8_supported", {"q8_matmul": matmul}, "q8_isa_supported"
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


def q8_matmul(x: torch.Tensor, weight: Q8Weight, isa: str | None = None) -> torch.Tensor:
    """`x [rows, K] @ W^T` (float32) for a `Q8Weight` W `[N, K]` over its exact weights; `isa`:
    one of `supported_isas()` (None: the fastest)."""
    library = _native().require(
        "the q8 CPU kernel is not available (not built, or no AVX2 and FMA)"
    )
    rows_out, cols = weight.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"q8_matmul takes a 2-d float32 CPU input, got {x.dtype} {x.dim()}-d")
    if x.shape[1] != cols:
        raise ValueError(f"q8_matmul: input width {x.shape[1]} != weight width {cols}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], rows_out, dtype=torch.float32)
    status = library.q8_matmul(
        _native().isa_number(isa),
        x.data_ptr(),
        x.shape[0],
        cols,
        weight.codes.data_ptr(),
        weight.scales.data_ptr(),
        rows_out,
        out.data_ptr(),
    )
    if status != 0:
        raise RuntimeError(f"q8_matmul failed with status {status}")
    return out
