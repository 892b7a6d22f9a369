"""Triton kernels of batched multi-LoRA (see `pagedserve_kernels.lora`): shrink and expand, each
program reading its token's own slot (punica's BGMV shape: one token per program row, so a batch
mixing adapters costs what one adapter costs).

Shrink: program (token, tile of N = P*R) computes `h[t, n] = sum_k A[slot_t, n, k] x[t, k]` in
float32 (zeros for slot -1). Expand: program (token, tile of w) adds
`sum_r B[slot_t, o, r] h[t, r]` to `y[t, o]` for one projection (tokens of slot -1 untouched).
Every pointer is addressed through strides, so `b`'s block-diagonal `[S, P*R, O]` storage is
read in place (each projection's block as a strided `[S, w, R]` view).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from pagedserve_kernels.lora import LoRAIndices, Reduce

BLOCK_N = 32
BLOCK_K = 64
BLOCK_O = 64
BLOCK_R = 16


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, h_ptr, N, K,
    stride_xt, stride_xk, stride_as, stride_an, stride_ak, stride_ht, stride_hn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if slot >= 0:
        for start in range(0, K, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token * stride_xt + offs_k * stride_xk, mask=offs_k < K, other=0.0)
            a = tl.load(
                a_ptr
                + slot * stride_as
                + offs_n[:, None] * stride_an
                + offs_k[None, :] * stride_ak,
                mask=(offs_n[:, None] < N) & (offs_k[None, :] < K),
                other=0.0,
            )
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(
        h_ptr + token * stride_ht + offs_n * stride_hn,
        acc.to(h_ptr.dtype.element_ty),
        mask=offs_n < N,
    )


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, slot_ptr, y_ptr, W, R,
    stride_ht, stride_hr, stride_bs, stride_bo, stride_br, stride_yt, stride_yo,
    BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        acc = tl.zeros([BLOCK_O], dtype=tl.float32)
        for start in range(0, R, BLOCK_R):
            offs_r = start + tl.arange(0, BLOCK_R)
            h = tl.load(h_ptr + token * stride_ht + offs_r * stride_hr, mask=offs_r < R, other=0.0)
            b = tl.load(
                b_ptr
                + slot * stride_bs
                + offs_o[:, None] * stride_bo
                + offs_r[None, :] * stride_br,
                mask=(offs_o[:, None] < W) & (offs_r[None, :] < R),
                other=0.0,
            )
            acc += tl.sum(b.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
        y_ptrs = y_ptr + token * stride_yt + offs_o * stride_yo
        y = tl.load(y_ptrs, mask=offs_o < W, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=offs_o < W)


def shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`[T, N]` float32: each token's slot's A (`a` `[S, N, K]`) times its row of `x`."""
    tokens, inputs = x.shape
    n = a.shape[1]
    h = torch.empty(tokens, n, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return h
    grid = (tokens, triton.cdiv(n, BLOCK_N))
    _shrink_kernel[grid](
        x, a, slots, h, n, inputs,
        *x.stride(), *a.stride(), *h.stride(),
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return h


def expand(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor) -> None:
    """`y[t] += b[slot_t] @ h[t]` in place (`b` `[S, W, R]`, any strides; `y` `[T, W]`)."""
    tokens, width = y.shape
    if tokens == 0:
        return
    grid = (tokens, triton.cdiv(width, BLOCK_O))
    _expand_kernel[grid](
        h, b, slots, y, width, h.shape[1],
        *h.stride(), *b.stride(), *y.stride(),
        BLOCK_O=BLOCK_O, BLOCK_R=BLOCK_R,
    )  # fmt: skip


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    widths: Sequence[int],
    indices: LoRAIndices,
    reduce: Reduce | None,
) -> None:
    """`pagedserve_kernels.lora.add_lora` on CUDA (or the interpreter): one shrink, then one expand
    per projection reading only its diagonal block of `b`."""
    rank = a.shape[1] // len(widths)
    slots = indices.slots.to(device=x.device, dtype=torch.int64).contiguous()
    h = shrink(x, a, slots)
    if reduce is not None:
        h = reduce(h)
    row = 0
    for p, width in enumerate(widths):
        block = b[:, p * rank : (p + 1) * rank, row : row + width].transpose(1, 2)  # [S, w, R]
        expand(h[:, p * rank : (p + 1) * rank], block, slots, y[:, row : row + width])
        row += width
