"""Batched multi-LoRA: add each token's adapter delta to a base linear layer's output.

One call handles one fused target of one layer (e.g. q/k/v, whose outputs the base layer
concatenates) for a batch whose tokens use different adapters (or none):

    y[t, rows_p] += B_p[slot_t] @ (A_p[slot_t] @ x[t])      for every projection p of the target

`a` is `[slots, P, R, K]` (P projections, rank padded to R with zeros) and `b` is `[O, slots, R]`
(the projections' output rows concatenated, `widths` giving each one's count; scaling folded in).
`LoRAIndices` is prepared once per step: the token -> slot map (-1: no adapter) and the range of
slots it uses.

Dispatch: Triton (`kernels.triton_lora`) for CUDA tensors: a shrink and an expand kernel that
read each token's own slot. Plain torch for CPU tensors: the tokens are multiplied by the A of
every slot in the step's slot range in one matmul (`[T, K] x [K, k*P*R]`), the rows of other
slots zeroed by a mask, and the expand is one matmul per projection over the same range
(`[T, k*R] x [k*R, w]`), read from `b` without a copy. Its op count does not grow with the
number of adapters in the batch (a gather per slot group would launch k times as many small
matmuls, which on a CPU costs more than the k-fold rank-sized work it saves at decode sizes).
`reference_add_lora` is the per-token oracle.

`reduce` (row-parallel layers under tensor parallelism) is applied to the shrunk intermediate:
each rank holds A's columns of its input shard, so the all-reduced intermediate is the whole
`A x`, and B (whole on every rank) is applied after.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LoRAIndices:
    """One step's token -> slot map. `slots`: `[T]` int64 (-1: base model); `lo`/`hi`: the
    slot range the step uses (`lo < hi`); `mask`: `[T, hi - lo]` (1 where the token's slot is
    `lo + j`), None when every token uses slot `lo` and `hi == lo + 1`."""

    slots: torch.Tensor
    lo: int
    hi: int
    mask: torch.Tensor | None


def prepare_indices(slots: torch.Tensor, dtype: torch.dtype) -> LoRAIndices | None:
    """The step's indices, or None when no token uses an adapter (nothing to add)."""
    used = slots[slots >= 0]
    if used.numel() == 0:
        return None
    lo, hi = int(used.min()), int(used.max()) + 1
    mask = None
    if hi - lo > 1 or used.numel() != slots.numel():
        columns = torch.arange(lo, hi, device=slots.device)
        mask = (slots[:, None] == columns[None, :]).to(dtype)
    return LoRAIndices(slots, lo, hi, mask)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    widths: Sequence[int],
    indices: LoRAIndices,
    reduce: Reduce | None = None,
) -> None:
    """`y[T, O] += delta` in place (see the module docstring); `x` is `[T, K]`."""
    if y.is_cuda:
        from kernels import triton_lora

        triton_lora.add_lora(y, x, a, b, widths, indices, reduce)
        return
    _add_lora_cpu(y, x, a, b, widths, indices, reduce)


def _add_lora_cpu(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    widths: Sequence[int],
    indices: LoRAIndices,
    reduce: Reduce | None,
) -> None:
    tokens = x.shape[0]
    _, fused, rank, inputs = a.shape
    lo, hi = indices.lo, indices.hi
    k = hi - lo
    shrunk = torch.matmul(x, a[lo:hi].reshape(k * fused * rank, inputs).t())
    shrunk = shrunk.view(tokens, k, fused, rank)
    if indices.mask is not None:
        shrunk = shrunk * indices.mask.view(tokens, k, 1, 1)
    if reduce is not None:
        shrunk = reduce(shrunk)
    wide = b[:, lo:hi].reshape(b.shape[0], k * rank)
    row = 0
    for p, width in enumerate(widths):
        part = shrunk[:, :, p].reshape(tokens, k * rank)
        y[:, row : row + width].addmm_(part, wide[row : row + width].t())
        row += width


def reference_add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    widths: Sequence[int],
    slots: torch.Tensor,
) -> None:
    """The oracle: token by token, its slot's A and B, in float64 (single rank)."""
    rank = a.shape[2]
    for t in range(x.shape[0]):
        slot = int(slots[t])
        if slot < 0:
            continue
        row = 0
        for p, width in enumerate(widths):
            h = a[slot, p].double() @ x[t].double()
            delta = b[row : row + width, slot, :rank].double() @ h
            y[t, row : row + width] += delta.to(y.dtype)
            row += width
