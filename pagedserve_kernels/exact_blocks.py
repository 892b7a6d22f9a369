"""Finding a block-quantized form (GGUF's Q4_1, Q8_0, ...) in a float32 matrix exactly, shared by
the native kernels' weight types (`pagedserve_kernels.q4_cpu.Q4Weight.recover`,
`pagedserve_kernels.q8_cpu.Q8Weight.recover`).

Invariant: `solve_exact_blocks` returns what `solve` returns for the whole matrix, or None; it
never returns a form for a matrix some of whose blocks `solve` refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

BLOCK = 32
"""Weights per block in the GGUF formats the kernels read."""

Solved = TypeVar("Solved")


def solve_exact_blocks(
    weight: torch.Tensor, solve: Callable[[torch.Tensor], Solved | None]
) -> Solved | None:
    """`solve(blocks)` over `weight`'s rows as `[rows, cols / 32, 32]` float32 CPU blocks, or
    None for a matrix that is not 2-d float32 with whole blocks, or whose blocks `solve`
    refuses. The first row is tried alone first, so a matrix of another form costs one row."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK:
        return None
    rows, cols = weight.shape
    blocks = weight.detach().to("cpu").contiguous().view(rows, cols // BLOCK, BLOCK)
    if rows == 0 or solve(blocks[:1]) is None:
        return None
    return solve(blocks)
