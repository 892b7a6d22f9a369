"""Device slots: stacked per-target LoRA buffers that the batched forward reads.

For each fused target (`qkv`, `o`, `gate_up`, `down`, see `workers.lora.shard`) two tensors
cover every layer and every slot:

- `a[target]`: `[layers, max_loras, in_local, P * max_rank]`, A transposed (P projections fused
  in the target, projection p's A^T in columns `p * max_rank ..`): the shrink multiplies the
  inputs by it as stored (`shrink_weights` gives the `[slots, P * max_rank, in]` view the
  kernels take);
- `b[target]`: `[layers, max_loras, P * max_rank, out_local]`, block-diagonal: projection p's
  `B^T` (scaling folded in) in rows `p * max_rank ..` and in the output columns the base layer
  gives that projection (their outputs concatenated), zeros elsewhere.

Invariants: a slot holds one adapter or nothing; every entry of a slot outside its adapter's
rank, or of a projection the adapter does not target, is zero (so padding the rank to
`max_rank` and absent projections add exactly nothing); slots are filled and cleared only
between forward passes (the rank applies a plan's slot loads before its forward pass).
Slot-major buffers make a run of slots one view (no copy) for the batched products; the
block-diagonal `b` applies every projection of a target in one product (P times the expand's
flops, which are rank-sized).
"""

from __future__ import annotations

import torch

from workers.config import ModelSpec
from workers.lora.shard import AdapterShard, TargetLayout, target_layouts
from workers.parallel import TensorParallel


class LoRASlots:
    """`max_loras` slots of adapters of rank up to `max_rank`, for one rank's model shard."""

    def __init__(
        self,
        spec: ModelSpec,
        tp: TensorParallel,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.num_layers = spec.num_layers
        self.tp = tp
        self.targets: dict[str, TargetLayout] = {t.name: t for t in target_layouts(spec, tp)}
        self.where: dict[str, tuple[str, int, int]] = {}
        """projection -> (target, index inside the target, first local output row)."""
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        layers = spec.num_layers
        for name, target in self.targets.items():
            ranks = len(target.projections) * max_rank
            self.a[name] = torch.zeros(
                layers, max_loras, target.local_inputs, ranks, dtype=dtype, device=device
            )
            self.b[name] = torch.zeros(
                layers, max_loras, ranks, sum(target.widths), dtype=dtype, device=device
            )
            row = 0
            for index, (projection, width) in enumerate(
                zip(target.projections, target.widths, strict=True)
            ):
                self.where[projection] = (name, index, row)
                row += width
        self.contents: list[str | None] = [None] * max_loras
        """The digest of the adapter each slot holds (None: empty)."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.a.values(), *self.b.values()))

    def shrink_weights(self, target: str, layer: int) -> torch.Tensor:
        """`[slots, P * max_rank, in_local]`: the layer's A of every slot (a transposed view)."""
        return self.a[target][layer].transpose(1, 2)

    def clear(self, slot: int) -> None:
        for name in self.targets:
            self.a[name][:, slot].zero_()
            self.b[name][:, slot].zero_()
        self.contents[slot] = None

    def fill(self, slot: int, shard: AdapterShard) -> None:
        """Writes `shard` into `slot` (zeroing what the slot held before)."""
        if shard.rank > self.max_rank:
            raise ValueError(f"adapter rank {shard.rank} exceeds max_lora_rank {self.max_rank}")
        self.clear(slot)
        r = shard.rank
        for (layer, projection), (a, b) in shard.pairs.items():
            name, index, row = self.where[projection]
            first = index * self.max_rank
            self.a[name][layer, slot, :, first : first + r].copy_(a.t())
            self.b[name][layer, slot, first : first + r, row : row + b.shape[0]].copy_(b.t())
        self.contents[slot] = shard.digest
