"""The KV layouts the engine can run: the paged one, and the research baselines beside it.

A layout is a `KVLayout` (`kv_layouts.layout`): its manager for the engine's scheduler (a
`block_manager.KVManager`), its pool for each rank (a `KVPool`), the settings it refuses and the
capabilities it has. `layout_named` is the only place its name is read. The baselines,
`contiguous` (max-length reservations, first fit) and `virtual` (a virtual range per slot,
committed on demand), exist to compare paged against on one runtime (`benchmarks.layouts`);
everything they need beyond the `KVManager` calls lives here.
"""

from kv_layouts.layout import KVBudget, KVLayout, KVPool, SequenceBounds
from kv_layouts.registry import LAYOUT_NAMES, build_kv_manager, layout_named

__all__ = [
    "LAYOUT_NAMES",
    "KVBudget",
    "KVLayout",
    "KVPool",
    "SequenceBounds",
    "build_kv_manager",
    "layout_named",
]
