"""Triton grouped matmul for mixture-of-experts layers: rows sorted by expert, one product per
expert in one launch.

``grouped_matmul(x, weights, offsets)``: ``x`` ``[rows, K]`` holds the rows of expert ``e`` at
``offsets[e]:offsets[e + 1]``; ``weights`` ``[experts, N, K]``; the result ``[rows, N]`` has
row ``i`` of expert ``e`` equal to ``x[i] @ weights[e].T``. The grid is ``(experts, row tiles of
the largest group, column tiles)``; a program whose tile lies past its expert's rows exits.
Accumulates in float32, stores in ``x``'s dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_kernel(
    x_ptr, w_ptr, out_ptr, offsets_ptr,
    n, k,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(0)
    tile_m = tl.program_id(1)
    tile_n = tl.program_id(2)
    first = tl.load(offsets_ptr + expert)
    last = tl.load(offsets_ptr + expert + 1)
    row_start = first + tile_m * BLOCK_M
    if row_start < last:
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < last
        col_ok = cols < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, k, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < k
            a = tl.load(
                x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
                + ks[:, None] * stride_wk,
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )  # fmt: skip
            if FP32_DOT:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """See the module doc. ``offsets`` ``[experts + 1]`` int, non-decreasing, from 0 to rows."""
    rows, k = x.shape
    experts, n, k_w = weights.shape
    if k_w != k or offsets.shape != (experts + 1,) or x.dtype != weights.dtype:
        raise ValueError(
            f"grouped_matmul: x {tuple(x.shape)} {x.dtype}, weights {tuple(weights.shape)} "
            f"{weights.dtype} and offsets {tuple(offsets.shape)} do not fit"
        )
    host = offsets.to("cpu", torch.int64)
    if int(host[0]) != 0 or int(host[-1]) != rows or bool((host[1:] < host[:-1]).any()):
        raise ValueError("grouped_matmul: offsets must rise from 0 to the row count")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    largest = int((host[1:] - host[:-1]).max())
    block_m, block_n, block_k = 16, 32, 32
    grid = (experts, triton.cdiv(largest, block_m), triton.cdiv(n, block_n))
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    _grouped_kernel[grid](
        x, weights, out, offsets.to(device=x.device, dtype=torch.int32),
        n, k,
        *x.stride(), *weights.stride(), *out.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        FP32_DOT=x.dtype == torch.float32 or (interpreting and x.dtype == torch.bfloat16),
    )  # fmt: skip
    return out
