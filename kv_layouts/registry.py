"""The `cache.kv_layout` setting: which manager the scheduler drives.

`build_kv_manager` returns the paged `KVCacheManager` or a range manager (`ContiguousKVManager`,
`VirtualKVManager`) behind the one `block_manager.KVManager` protocol, so the scheduler, model,
sampling and workload are the same under every layout. The worker side of the setting is
`kv_layouts.pools`; the layouts benchmark measures a layout from outside the engine's step
(`benchmarks.layout_recorder`).
"""

from __future__ import annotations

import math

from block_manager import KVCacheManager, KVManager
from cluster.engine.config import EngineConfig
from kv_layouts.contiguous import ContiguousKVManager
from kv_layouts.virtual import VirtualKVManager
from kv_layouts.virtual_pool import virtual_geometry
from workers import ModelInfo


def build_kv_manager(
    config: EngineConfig,
    info: ModelInfo,
    num_device_blocks: int,
    num_cpu_blocks: int,
    *,
    record_events: bool = False,
) -> KVManager:
    """The manager of `config.cache.kv_layout` over a budget of `num_device_blocks` blocks;
    `record_events` keeps its `BlockEvent`s for a cluster-wide index (paged layout only: the
    range layouts cache nothing)."""
    cache = config.cache
    watermark = min(num_device_blocks - 1, math.floor(cache.watermark * num_device_blocks))
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
