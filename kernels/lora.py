"""Batched multi-LoRA: add each token's adapter delta to a base linear layer's output.

One call handles one fused target of one layer (e.g. q/k/v, whose outputs the base layer
concatenates) for a batch whose tokens use different adapters (or none):

    y[t, rows_p] += B_p[slot_t] @ (A_p[slot_t] @ x[t])      for every projection p of the target

`a` is `[slots, P, R, K]` (P projections, rank padded to R with zeros) and `b` is `[O, slots, R]`
(the projections' output rows concatenated, `widths` giving each one's count; scaling folded in).
`LoRAIndices` is prepared once per step: the token -> slot map (-1: no adapter) and the range of
slots it uses.

Dispatch: Triton (`kernels.triton_lora`) for CUDA tensors: a shrink and an expand kernel that
read each token's own slot. Plain torch for CPU tensors, gather-based: the step's tokens with an
adapter are put in slot order once (`LoRAIndices.order`, one `index_select` per target), each
slot group is then a contiguous run multiplied by its own slot's A (`[n_g, K] x [K, P*R]`) and,
per projection, its B, and the deltas are added back in one `index_add_`. When every token uses
one slot nothing is gathered and the products go straight into `y`. A token costs only its own
adapter's work (a dense product over all the step's slots with a mask costs k times the flops,
which at rank 16 is most of the LoRA time on a CPU). `reference_add_lora` is the per-token
oracle.

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
    """One step's token -> slot map, prepared once for every layer.

    `slots`: `[T]` int64 (-1: base model). `order`: the indices of the tokens with an adapter,
    sorted by slot (stable), or None when every token uses one slot (no gather needed).
    `groups`: `(slot, start, stop)` runs of `order` (of the batch when `order` is None)."""

    slots: torch.Tensor
    order: torch.Tensor | None
    groups: tuple[tuple[int, int, int], ...]


def prepare_indices(slots: torch.Tensor) -> LoRAIndices | None:
    """The step's indices, or None when no token uses an adapter (nothing to add)."""
    adapted = torch.nonzero(slots >= 0).flatten()
    if adapted.numel() == 0:
        return None
    first = int(slots[adapted[0]])
    if adapted.numel() == slots.numel() and bool((slots == first).all()):
        return LoRAIndices(slots, None, ((first, 0, slots.numel()),))
    keys = slots.index_select(0, adapted)
    ranked = torch.argsort(keys, stable=True)
    order = adapted.index_select(0, ranked)
    values, counts = torch.unique_consecutive(keys.index_select(0, ranked), return_counts=True)
    groups, start = [], 0
    for slot, count in zip(values.tolist(), counts.tolist(), strict=True):
        groups.append((slot, start, start + count))
        start += count
    return LoRAIndices(slots, order, tuple(groups))


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
    _, fused, rank, inputs = a.shape
    order = indices.order
    gathered = x if order is None else x.index_select(0, order)
    shrunk = torch.empty(gathered.shape[0], fused * rank, dtype=x.dtype, device=x.device)
    for slot, start, stop in indices.groups:
        torch.mm(
            gathered[start:stop], a[slot].reshape(fused * rank, inputs).t(), out=shrunk[start:stop]
        )
    if reduce is not None:
        shrunk = reduce(shrunk)
    target = y if order is None else torch.zeros(shrunk.shape[0], y.shape[1], dtype=y.dtype)
    for slot, start, stop in indices.groups:
        row = 0
        for p, width in enumerate(widths):
            part = shrunk[start:stop, p * rank : (p + 1) * rank]
            target[start:stop, row : row + width].addmm_(part, b[row : row + width, slot].t())
            row += width
    if order is not None:
        y.index_add_(0, order, target)


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
