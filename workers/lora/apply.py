"""The LoRA step of one forward pass: which slot each token uses, applied after a base linear.

The model calls `column` after a column-parallel base linear (q/k/v fused, gate/up fused) and
`row` after a row-parallel one (o, down), handing the layer's input and its output; the delta is
added to the output in place. Nothing else in the model knows about adapters, so the base
layers stay as they are (`workers.layers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve_kernels.lora import LoRAIndices, add_lora, prepare_indices
from workers.lora.slots import LoRASlots


@dataclass(frozen=True)
class LoRAStep:
    """One forward pass's adapters: the slots and the prepared token -> slot indices."""

    slots: LoRASlots
    indices: LoRAIndices

    @classmethod
    def prepare(cls, slots: LoRASlots, token_slots: torch.Tensor) -> LoRAStep | None:
        """None when no token uses an adapter (the forward pass then does no LoRA work)."""
        indices = prepare_indices(token_slots)
        return None if indices is None else cls(slots, indices)

    def column(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """`y += delta(x)` after a column-parallel base linear (output rows of this rank)."""
        add_lora(
            y,
            x,
            self.slots.shrink_weights(target, layer),
            self.slots.b[target][layer],
            self.slots.targets[target].widths,
            self.indices,
        )

    def row(self, layer: int, target: str, x_shard: torch.Tensor, y: torch.Tensor) -> None:
        """`y += delta(x)` after a row-parallel base linear (already all-reduced): `x_shard` is
        this rank's input columns; the rank-sized intermediate is all-reduced across ranks."""
        tp = self.slots.tp
        add_lora(
            y,
            x_shard,
            self.slots.shrink_weights(target, layer),
            self.slots.b[target][layer],
            self.slots.targets[target].widths,
            self.indices,
            tp.all_reduce if tp.world_size > 1 else None,
        )
