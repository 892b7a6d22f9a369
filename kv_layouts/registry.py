"""The `cache.kv_layout` setting: every layout by name, and the engine's manager of one.

`layout_named` is the one place a layout's name is turned into behaviour; the engine and each
rank ask it once (`EngineCore`, `WorkerRank`) and hold the `KVLayout` from then on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from block_manager import KVManager
from kv_layouts.contiguous import ContiguousLayout
from kv_layouts.layout import KVBudget, KVLayout, SequenceBounds
from kv_layouts.paged import PagedLayout
from kv_layouts.virtual import VirtualLayout

if TYPE_CHECKING:
    from cluster.engine.config import EngineConfig
    from workers.config import ModelInfo

_LAYOUTS: Mapping[str, KVLayout] = MappingProxyType(
    {layout.name: layout for layout in (PagedLayout(), ContiguousLayout(), VirtualLayout())}
)

LAYOUT_NAMES: tuple[str, ...] = tuple(_LAYOUTS)
"""Every `cache.kv_layout` value, the default ('paged') first."""


def layout_named(name: str) -> KVLayout:
    """The layout `cache.kv_layout` names; ValueError naming the setting for an unknown one."""
    layout = _LAYOUTS.get(name)
    if layout is None:
        raise ValueError(f"kv_layout {name!r} is not one of {list(LAYOUT_NAMES)}")
    return layout


def build_kv_manager(
    layout: KVLayout,
    config: EngineConfig,
    info: ModelInfo,
    num_device_blocks: int,
    num_cpu_blocks: int,
    *,
    bounds: SequenceBounds,
    record_events: bool = False,
) -> KVManager:
    """`layout`'s manager over a budget of `num_device_blocks` blocks (`cache.watermark` of
    them kept free at admission); `bounds`: each sequence's most tokens; `record_events` keeps
    the `BlockEvent`s of a layout that seals blocks, for a cluster-wide index."""
    cache = config.cache
    watermark = min(num_device_blocks - 1, math.floor(cache.watermark * num_device_blocks))
    tp = config.parallel.tensor_parallel_size
    return layout.build_manager(
        KVBudget(
            num_device_blocks=num_device_blocks,
            num_cpu_blocks=num_cpu_blocks,
            block_size=cache.block_size,
            watermark_blocks=watermark,
            max_model_len=info.max_model_len,
            max_num_seqs=config.scheduler.seats(config.engine_device()),
            plane_block_bytes=info.kv_bytes_per_block // (2 * info.num_layers * tp),
            enable_prefix_caching=cache.enable_prefix_caching,
            cpu_cache=cache.cpu_cache,
            record_events=record_events,
            bounds=bounds,
            kv_group_windows=info.kv_group_windows,
        )
    )
