"""`KVLayout`: one KV layout's engine half (its manager) and worker half (its pool), by name.

The engine looks its layout up once (`kv_layouts.layout_named(config.cache.kv_layout)`) and
from then on holds a `KVManager` and a few capabilities; a rank looks it up once and holds a
`KVPool`. Nothing else asks which layout runs: the scheduler, the step plans, the model and the
attention kernels are the same under every layout, and a layout's pool derives what it needs
(which memory to hand back, for instance) from the block tables and releases every plan
already carries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from block_manager import KVManager, SeqId

if TYPE_CHECKING:
    import torch

    from cluster.engine.config import EngineConfig
    from workers.config import WorkerConfig
    from workers.kv_memory import KVShape

PoolAllocator = Callable[[int, "torch.device"], "torch.Tensor"]
"""(num_blocks, device) -> a KV pool tensor of the rank's shape."""


class SequenceBounds(Protocol):
    """The most tokens (prompt + output) a live sequence may ever hold, as the engine knows it
    from its request; None for a sequence it does not know."""

    def max_tokens(self, seq_id: SeqId) -> int | None: ...


@dataclass(frozen=True)
class KVBudget:
    """What a layout's manager is built from: the engine's settings and the workers' sizes.

    `plane_block_bytes`: bytes of one block in one (layer, K/V) plane of one rank's pool.
    `bounds`: each sequence's most tokens (a layout that reserves by length reads it).
    `plane_block_bytes` is one group's plane under hybrid KV groups.
    """

    num_device_blocks: int
    num_cpu_blocks: int
    block_size: int
    watermark_blocks: int
    max_model_len: int
    max_num_seqs: int
    plane_block_bytes: int
    enable_prefix_caching: bool
    cpu_cache: bool
    record_events: bool
    bounds: SequenceBounds
    kv_group_windows: tuple[int | None, ...] = ()
    """Hybrid KV groups: each group's sliding window (None: full attention) in the workers'
    group order (`ModelInfo.kv_group_windows`); empty when every layer keeps every block."""


class KVPool(Protocol):
    """A rank's device KV pool under one layout.

    Invariant: `allocate` is called once before `released` or `resident_bytes`.
    """

    def allocate(
        self, num_device_blocks: int, device: torch.device, allocate_pool: PoolAllocator
    ) -> torch.Tensor:
        """The pool tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]`."""
        ...

    def released(self, block_tables: Sequence[Sequence[int]]) -> None:
        """The plan about to run releases sequences whose cached tables were these; called
        before its forward pass, so memory handed back is not yet reused."""
        ...

    def resident_bytes(self) -> int | None:
        """Bytes of the pool physically backed, when this pool can measure them."""
        ...

    @property
    def returned_ranges(self) -> int:
        """Block ranges handed back to the OS so far (0 for a pool that never hands any)."""
        ...

    def release(self) -> None: ...


class KVLayout(Protocol):
    """One KV layout (see the module docstring)."""

    @property
    def name(self) -> str:
        """The `cache.kv_layout` value that picks it."""
        ...

    @property
    def can_fork(self) -> bool:
        """Sequences can share blocks (parallel sampling, n > 1)."""
        ...

    @property
    def shares_prefixes(self) -> bool:
        """Blocks are sealed under prefix hashes: prefix caching, the cluster-wide index and
        KV transfers between replicas work (with `cache.enable_prefix_caching`)."""
        ...

    @property
    def groups_layers(self) -> bool:
        """The layout runs hybrid KV groups (`workers.kv_groups`): a sliding-window
        model's layers grouped by window, each group with its own tables over one pool."""
        ...

    @property
    def has_swap_tier(self) -> bool:
        """The layout can swap sequences to a CPU pool (else the workers allocate none)."""
        ...

    def validate(self, config: EngineConfig) -> None:
        """Raises ValueError naming the setting (`section.field`) this layout cannot run."""
        ...

    def build_manager(self, budget: KVBudget) -> KVManager: ...

    def build_pool(self, config: WorkerConfig, kv_shape: KVShape, max_model_len: int) -> KVPool:
        """A rank's pool (`max_model_len`: the rank's resolved context)."""
        ...
