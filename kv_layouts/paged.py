"""The `paged` layout: `block_manager.KVCacheManager` over a dense pool of blocks, or
`block_manager.hybrid.HybridKVManager` (per-group tables over that one pool) where the workers
grouped a sliding-window model's layers.

The one layout the serving path is built around: prefix caching, the CPU cache tier, swapping,
forks for parallel sampling, block events for the cluster-wide index and KV transfers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from block_manager import KVCacheManager, KVManager
from block_manager.hybrid import HybridKVManager
from kv_layouts.layout import KVBudget, KVPool

if TYPE_CHECKING:
    from cluster.engine.config import EngineConfig
    from workers.config import WorkerConfig
    from workers.kv_memory import KVShape

logger = logging.getLogger(__name__)


class PagedLayout:
    """The `paged` layout (see the module docstring)."""

    name = "paged"
    can_fork = True
    shares_prefixes = True
    groups_layers = True
    has_swap_tier = True

    def validate(self, config: EngineConfig) -> None:
        """Every engine setting runs paged."""

    def build_manager(self, budget: KVBudget) -> KVManager:
        if budget.kv_group_windows:
            return _hybrid_manager(budget)
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


def _hybrid_manager(budget: KVBudget) -> HybridKVManager:
    """Per-group tables over one pool (`block_manager.hybrid`). It records no block events
    (a cluster-wide index does not follow per-group blocks): a replica that asked for them is
    told once, in the log, that the index sees none of its blocks. The CPU cache tier stays
    off under it."""
    windows = list(budget.kv_group_windows)
    if budget.record_events:
        logger.warning(
            "hybrid KV groups (windows %s): this replica publishes no blocks to the KV "
            "directory and takes part in no KV transfers; --disable-hybrid-kv-cache-manager "
            "keeps every layer's blocks and restores both",
            windows,
        )
    if budget.cpu_cache and budget.enable_prefix_caching and budget.num_cpu_blocks > 0:
        logger.info(
            "hybrid KV groups (windows %s): the CPU cache tier is off; the CPU pool holds "
            "swapped-out sequences only",
            windows,
        )
    return HybridKVManager(
        windows=budget.kv_group_windows,
        num_device_blocks=budget.num_device_blocks,
        num_cpu_blocks=budget.num_cpu_blocks,
        block_size=budget.block_size,
        enable_prefix_caching=budget.enable_prefix_caching,
        watermark_blocks=min(budget.num_device_blocks - 2, budget.watermark_blocks),
    )
