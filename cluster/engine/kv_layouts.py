"""The `cache.kv_layout` setting: which manager the scheduler drives.

`build_kv_manager` returns the paged `KVCacheManager` or a range manager (`ContiguousKVManager`,
`VirtualKVManager`) behind the one `block_manager.KVManager` protocol, so the scheduler, model,
sampling and workload are the same under every layout. The worker side of the setting is
`workers.pool_layouts`; the layouts benchmark measures a layout from outside the engine's step
(`benchmarks.layout_recorder`).
"""

from __future__ import annotations

import logging
import math

from block_manager import (
    ContiguousKVManager,
    KVCacheManager,
    KVManager,
    VirtualKVManager,
)
from block_manager.hybrid import HybridKVManager
from cluster.engine.config import EngineConfig
from workers import ModelInfo
from workers.virtual_pool import virtual_geometry

logger = logging.getLogger(__name__)


def build_kv_manager(
    config: EngineConfig,
    info: ModelInfo,
    num_device_blocks: int,
    num_cpu_blocks: int,
    *,
    record_events: bool = False,
) -> KVManager:
    """The manager of `config.cache.kv_layout` over a budget of `num_device_blocks` blocks
    (the hybrid one when the workers grouped the layers, `ModelInfo.kv_group_windows`);
    `record_events` keeps its `BlockEvent`s for a cluster-wide index (paged layout only: the
    range layouts cache nothing)."""
    cache = config.cache
    watermark = min(num_device_blocks - 1, math.floor(cache.watermark * num_device_blocks))
    if info.kv_group_windows:
        return _hybrid_manager(config, info, num_device_blocks, num_cpu_blocks, record_events)
    if cache.kv_layout == "paged":
        return KVCacheManager(
            num_device_blocks=num_device_blocks,
            num_cpu_blocks=num_cpu_blocks,
            block_size=cache.block_size,
            enable_prefix_caching=cache.enable_prefix_caching,
            cpu_cache=cache.cpu_cache,
            watermark_blocks=watermark,
            record_events=record_events,
        )
    if cache.kv_layout == "contiguous":
        return ContiguousKVManager(
            num_device_blocks=num_device_blocks,
            block_size=cache.block_size,
            max_model_len=info.max_model_len,
            watermark_blocks=watermark,
        )
    tp = config.parallel.tensor_parallel_size
    plane_block_bytes = info.kv_bytes_per_block // (2 * info.num_layers * tp)
    geometry = virtual_geometry(
        config.scheduler.max_num_seqs, info.max_model_len, cache.block_size, plane_block_bytes
    )
    return VirtualKVManager(
        num_device_blocks=num_device_blocks,
        block_size=cache.block_size,
        max_model_len=info.max_model_len,
        num_slots=geometry.num_slots,
        slot_blocks=geometry.slot_blocks,
        commit_blocks=geometry.commit_blocks,
        watermark_blocks=watermark,
    )


def _hybrid_manager(
    config: EngineConfig,
    info: ModelInfo,
    num_device_blocks: int,
    num_cpu_blocks: int,
    record_events: bool,
) -> HybridKVManager:
    """Per-group tables over one pool (`block_manager.hybrid`). It records no block events
    (a cluster-wide index does not follow per-group blocks): a replica that asked for them is
    told once, in the log, that the index sees none of its blocks. The CPU cache tier stays
    off under it."""
    if record_events:
        logger.warning(
            "hybrid KV groups (windows %s): this replica publishes no blocks to the KV "
            "directory and takes part in no KV transfers; --disable-hybrid-kv-cache-manager "
            "keeps every layer's blocks and restores both",
            list(info.kv_group_windows),
        )
    cache = config.cache
    if cache.cpu_cache and cache.enable_prefix_caching and num_cpu_blocks > 0:
        logger.info(
            "hybrid KV groups (windows %s): the CPU cache tier is off; the CPU pool holds "
            "swapped-out sequences only",
            list(info.kv_group_windows),
        )
    return HybridKVManager(
        windows=info.kv_group_windows,
        num_device_blocks=num_device_blocks,
        num_cpu_blocks=num_cpu_blocks,
        block_size=cache.block_size,
        enable_prefix_caching=cache.enable_prefix_caching,
        watermark_blocks=min(
            num_device_blocks - 2, math.floor(cache.watermark * num_device_blocks)
        ),
    )
