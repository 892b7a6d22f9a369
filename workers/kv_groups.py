"""KV cache groups: which layers share a block table, and how a block id maps to their bytes.

A model whose layers attend over different spans (full attention; a sliding window of `w`
tokens) need not keep every block of a sequence in every layer: a sliding layer never reads
keys more than `w - 1` positions behind its query. Layers are grouped by attention kind, each
group has its own block table per sequence (`block_manager.hybrid.HybridKVManager`), and a
sliding group drops the blocks its window has passed.

Memory design (ours, after vLLM v1's hybrid KV cache manager). Every group holds the same
number of layers, `slots` (the smallest kind's layer count; a larger kind is cut into
several groups of `slots` layers, the last possibly short). The workers' pool tensor is
`[slots, 2, num_blocks, ...]` instead of `[num_layers, 2, num_blocks, ...]`: layer `i` reads
and writes pool row `layer_slot[i]` through the table of group `layer_group[i]`. So one
physical block id means `slots` layers' bytes of whichever group holds it, every group
allocates from ONE shared block pool (no fixed split of memory between kinds), and copies,
swaps and copy-on-writes stay single indexed operations over the pool's block dimension, as
in the full layout. With one group (every layer of one kind) the pool is the full layout's.

Why not one pool per kind: the split between kinds would have to be fixed up front, and
their ratio depends on the workload (context lengths); the shared pool adapts. Why not keep
`[num_layers, ...]` and free sliding blocks only in sliding layers: a block id would then
name bytes in every layer, so freeing it in one group would leave the others' bytes unusable.

Invariant: `layer_group` and `layer_slot` together name each (group, slot) pair at most once,
and `slots * len(windows) >= num_layers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroupLayout:
    """The grouping of a model's layers (see the module docstring)."""

    windows: tuple[int | None, ...]
    """Each group's sliding window in tokens (None: full attention)."""
    layer_group: tuple[int, ...]
    """Layer i's group."""
    layer_slot: tuple[int, ...]
    """Layer i's row of the pool tensor (its position within its group)."""
    slots: int
    """Layers per group: the pool tensor's first dimension."""

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Whether any group drops blocks (a sliding window), so the hybrid manager runs it."""
        return any(window is not None for window in self.windows)


def full_layout(num_layers: int) -> KVGroupLayout:
    """One full-attention group of every layer: the layout without hybrid groups."""
    return KVGroupLayout((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def group_layers(layer_windows: Sequence[int | None], *, enabled: bool = True) -> KVGroupLayout:
    """Layers grouped by window (`enabled` False, or no window at all: `full_layout`).

    Groups are ordered by their first layer; each kind's layers are cut, in layer order, into
    groups of the smallest kind's layer count."""
    num_layers = len(layer_windows)
    if not enabled or all(window is None for window in layer_windows):
        return full_layout(num_layers)
    kinds: dict[int | None, list[int]] = {}
    for index, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(index)
    slots = min(len(layers) for layers in kinds.values())
    chunks = [
        (window, layers[start : start + slots])
        for window, layers in kinds.items()
        for start in range(0, len(layers), slots)
    ]
    chunks.sort(key=lambda chunk: chunk[1][0])
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for group, (_, layers) in enumerate(chunks):
        for slot, layer in enumerate(layers):
            layer_group[layer], layer_slot[layer] = group, slot
    return KVGroupLayout(
        tuple(window for window, _ in chunks), tuple(layer_group), tuple(layer_slot), slots
    )
