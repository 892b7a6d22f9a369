"""Batched multi-LoRA: add each token's adapter delta to a base linear layer's output.

One call handles one fused target of one layer (e.g. q/k/v, whose outputs the base layer
concatenates) for a batch whose tokens use different adapters (or none):

    y[t, rows_p] += B_p[slot_t] @ (A_p[slot_t] @ x[t])      for every projection p of the target

`a` is `[slots, P * R, K]` (P projections, each rank padded to R with zeros; the workers pass a
transposed view of `[slots, K, P * R]` storage, which the CPU products read contiguously) and `b` is
`[slots, P * R, O]`, block-diagonal: projection p's rows `p*R .. p*R + R` hold `B_p^T` in its
output columns (the projections' outputs concatenated, `widths` giving each one's count) and
zeros elsewhere, so one product applies every projection of the target (scaling folded in).
`LoRAIndices` is prepared once per step from the token -> slot map (-1: no adapter).

Dispatch: Triton (`pagedserve_kernels.triton_lora`) for CUDA tensors: a shrink and an expand kernel
that read each token's own slot (punica's BGMV shape). Plain torch for CPU tensors, gather-based:
the tokens with an adapter are gathered by slot into `[G, n, K]` (G slot groups, each padded to the
largest group's n), and two batched products (`bmm` with each group's own A, then its own B)
give the deltas, scattered back with one `index_add_`. The op count per target is constant
whatever the number of adapters (on a CPU the small products' dispatch, not their flops,
dominates at decode sizes), and a token pays only its own adapter's flops. When padding would
more than double the work (one long prefill beside single decode tokens) the groups run one by
one instead. The CPU products run in the weights' dtype (the workers keep CPU slots float32,
whatever the model's dtype) and the delta is added to `y` in `y`'s. `reference_add_lora` is the
per-token oracle.

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

    `slots`: `[T]` int64 (-1: base model). `groups`: `(slot, start, stop)` runs of the adapted
    tokens in slot order. `gather`: `[G * n]` token index of each padded group row (padding
    rows repeat a valid token; their results are dropped), None when every token uses one slot.
    `rows`: for each adapted token in slot order, its padded row (None when no group is padded:
    the rows are the tokens in order); `order`: those tokens' indices into the batch.
    `group_slots`: `[G]` the groups' slots (None: they are `lo, lo + 1, ...`, a view of the slot
    buffers needs no copy). `padded`: False when the groups run one by one."""

    slots: torch.Tensor
    groups: tuple[tuple[int, int, int], ...]
    gather: torch.Tensor | None
    rows: torch.Tensor | None
    order: torch.Tensor | None
    group_slots: torch.Tensor | None
    width: int
    padded: bool

    @property
    def lo(self) -> int:
        return self.groups[0][0]


def prepare_indices(slots: torch.Tensor) -> LoRAIndices | None:
    """The step's indices, or None when no token uses an adapter (nothing to add)."""
    adapted = torch.nonzero(slots >= 0).flatten()
    if adapted.numel() == 0:
        return None
    first = int(slots[adapted[0]])
    tokens = slots.numel()
    if adapted.numel() == tokens and bool((slots == first).all()):
        return LoRAIndices(slots, ((first, 0, tokens),), None, None, None, None, tokens, True)
    keys = slots.index_select(0, adapted)
    ranked = torch.argsort(keys, stable=True)
    order = adapted.index_select(0, ranked)
    values, counts = torch.unique_consecutive(keys.index_select(0, ranked), return_counts=True)
    group_slots, sizes = values.tolist(), counts.tolist()
    groups, start = [], 0
    for slot, size in zip(group_slots, sizes, strict=True):
        groups.append((slot, start, start + size))
        start += size
    width = max(sizes)
    padded = len(sizes) * width <= 2 * adapted.numel()
    gather_list: list[int] = []
    rows: list[int] = []
    order_list = order.tolist()
    for index, (_, begin, end) in enumerate(groups):
        rows.extend(range(index * width, index * width + end - begin))
        members = order_list[begin:end]
        gather_list.extend(members + [members[0]] * (width - len(members)))
    contiguous = group_slots == list(range(group_slots[0], group_slots[0] + len(group_slots)))
    device = slots.device
    unpadded = len(rows) == len(groups) * width
    return LoRAIndices(
        slots,
        tuple(groups),
        torch.tensor(gather_list, dtype=torch.int64, device=device),
        None if unpadded else torch.tensor(rows, dtype=torch.int64, device=device),
        order,
        None if contiguous else values,
        width,
        padded,
    )


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
        from pagedserve_kernels import triton_lora

        triton_lora.add_lora(y, x, a, b, widths, indices, reduce)
        return
    if indices.padded:
        _add_lora_batched(y, x, a, b, indices, reduce)
    else:
        _add_lora_groups(y, x, a, b, indices, reduce)


def _group_weights(weights: torch.Tensor, indices: LoRAIndices) -> torch.Tensor:
    """The groups' slots of a `[slots, ...]` buffer: a view for a run of slots, else a copy."""
    if indices.group_slots is None:
        return weights[indices.lo : indices.lo + len(indices.groups)]
    return weights.index_select(0, indices.group_slots)


def _add_lora_batched(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    indices: LoRAIndices,
    reduce: Reduce | None,
) -> None:
    count, width = len(indices.groups), indices.width
    x = x.to(a.dtype)
    if indices.gather is None:
        gathered = x.view(1, width, x.shape[1])
    else:
        gathered = x.index_select(0, indices.gather).view(count, width, x.shape[1])
    shrunk = torch.bmm(gathered, _group_weights(a, indices).transpose(1, 2))
    if reduce is not None:
        shrunk = reduce(shrunk)
    if indices.gather is None:
        if y.dtype == b.dtype:
            y.addmm_(shrunk[0], b[indices.lo])
        else:
            y.add_(torch.mm(shrunk[0], b[indices.lo]).to(y.dtype))
        return
    delta = torch.bmm(shrunk, _group_weights(b, indices)).view(count * width, y.shape[1])
    assert indices.order is not None
    if indices.rows is not None:
        delta = delta.index_select(0, indices.rows)
    y.index_add_(0, indices.order, delta.to(y.dtype))


def _add_lora_groups(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    indices: LoRAIndices,
    reduce: Reduce | None,
) -> None:
    """Groups of very different sizes: each group's own products, no padding."""
    assert indices.order is not None
    gathered = x.index_select(0, indices.order).to(a.dtype)
    shrunk = torch.empty(gathered.shape[0], a.shape[1], dtype=a.dtype, device=x.device)
    for slot, start, stop in indices.groups:
        torch.mm(gathered[start:stop], a[slot].t(), out=shrunk[start:stop])
    if reduce is not None:
        shrunk = reduce(shrunk)
    delta = torch.empty(shrunk.shape[0], y.shape[1], dtype=b.dtype, device=y.device)
    for slot, start, stop in indices.groups:
        torch.mm(shrunk[start:stop], b[slot], out=delta[start:stop])
    y.index_add_(0, indices.order, delta.to(y.dtype))


def reference_add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    widths: Sequence[int],
    slots: torch.Tensor,
) -> None:
    """The oracle: token by token and projection by projection, its slot's A and B (float64,
    single rank), reading only the diagonal blocks of `b`."""
    rank = a.shape[1] // len(widths)
    for t in range(x.shape[0]):
        slot = int(slots[t])
        if slot < 0:
            continue
        row = 0
        for p, width in enumerate(widths):
            ranks = slice(p * rank, (p + 1) * rank)
            h = a[slot, ranks].double() @ x[t].double()
            delta = b[slot, ranks, row : row + width].double().t() @ h
            y[t, row : row + width] += delta.to(y.dtype)
            row += width
