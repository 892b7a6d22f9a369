"""Plain-torch oracles of `pagedserve_kernels.quant_dot_cpu`: the activation quantization (the same
float32 operations, so bit for bit), the integer arithmetic of its product (in float64, with the
float32 summation bound), and the bound of its distance from the float32 product over the same
weights."""

from __future__ import annotations

import torch

BLOCK = 32


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int8 `[rows, K]`, d and d * sum(codes) float32 `[rows, K / 32]`) of `x [rows, K]`:
    per block of 32, d = max|x| / 127 and codes = round_half_even(x * (1 / d)) (0 where d = 0)."""
    rows, cols = x.shape
    blocks = x.float().view(rows, cols // BLOCK, BLOCK)
    scales = blocks.abs().amax(dim=2) / 127.0
    inverse = torch.where(scales != 0, 1.0 / scales, torch.zeros_like(scales))
    codes = torch.round(blocks * inverse[:, :, None])  # torch.round: half to even
    sums = scales * codes.sum(dim=2)
    return codes.to(torch.int8).view(rows, cols), scales, sums


def reference_product(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's arithmetic in float64, its float32 summation bound), `[rows, N]`, for
    unsigned weight codes `[N, K]` with `scales` and `mins` `[N, K / 32]`: per block the exact
    integer sum of codes times activation codes, times scale * d, plus min * d * sum(codes)."""
    a, d, s = reference_quantize(x)
    rows, cols = a.shape
    u = codes.to(torch.float64).view(codes.shape[0], cols // BLOCK, BLOCK)
    integer = torch.einsum("rbk,nbk->rnb", a.to(torch.float64).view(rows, -1, BLOCK), u)
    scaled = integer * (scales.double()[None] * d.double()[:, None, :])
    shifted = mins.double()[None] * s.double()[:, None, :]
    terms = scaled.abs().sum(dim=2) + shifted.abs().sum(dim=2)
    bound = (2 * cols // BLOCK + 4) * 2**-24 * terms + 1e-30
    return (scaled + shifted).sum(dim=2), bound


def activation_rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`[rows, N]`: how far the kernel may be from `x @ weight.T` (float32 weights): every
    activation is within d / 2 of its 8-bit grid point (a little more for the float32 rounding of
    x * (1 / d)), so per block (d / 2) * sum |w|, plus float32 summation of both products."""
    cols = x.shape[1]
    _, d, _ = reference_quantize(x)
    weight_mass = weight.double().abs().view(weight.shape[0], cols // BLOCK, BLOCK).sum(dim=2)
    grid = (d.double()[:, None, :] * 0.5 * (1 + 2**-13) * weight_mass[None]).sum(dim=2)
    summation = cols * 2**-22 * (x.double().abs() @ weight.double().abs().T)
    return grid + summation + 1e-30
