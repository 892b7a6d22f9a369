"""The `paged` layout: `block_manager.KVCacheManager` over a dense pool of blocks.

The one layout the serving path is built around: prefix caching, the CPU cache tier, swapping,
forks for parallel sampling, block events for the cluster-wide index and KV transfers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from block_manager import KVCacheManager
from kv_layouts.layout import KVBudget, KVPool

if TYPE_CHECKING:
    from cluster.engine.config import EngineConfig
    from workers.config import WorkerConfig
    from workers.kv_memory import KVShape


class PagedLayout:
    """The `paged` layout (see the module docstring)."""

    name = "paged"
    can_fork = True
    shares_prefixes = True
    has_swap_tier = True

    def validate(self, config: EngineConfig) -> None:
        """Every engine setting runs paged."""

    def build_manager(self, budget: KVBudget) -> KVCacheManager:
        return KVCacheManager(
            num_device_blocks=budget.num_device_blocks,
            num_cpu_blocks=budget.num_cpu_blocks,
            block_size=budget.block_size,
            enable_prefix_caching=budget.enable_prefix_caching,
            cpu_cache=budget.cpu_cache,
            watermark_blocks=budget.watermark_blocks,
            record_events=budget.record_events,
        )

    def build_pool(self, config: WorkerConfig, kv_shape: KVShape, max_model_len: int) -> KVPool:
        from kv_layouts.pools import DensePool

        return DensePool()
