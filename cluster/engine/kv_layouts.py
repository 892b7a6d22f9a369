"""The `cache.kv_layout` setting: which manager the scheduler drives, and its accounting.

`build_kv_manager` returns the paged `KVCacheManager` or a range manager (`ContiguousKVManager`,
`VirtualKVManager`) behind the one `block_manager.KVManager` protocol, so the scheduler, model,
sampling and workload are the same under every layout. `LayoutRecorder` is the layouts
benchmark's: it runs an engine's steps (`LayoutRecorder.step`, in place of `EngineCore.step`) and
samples, at each, bytes reserved, bytes physically backed and bytes holding live tokens (plus
internal fragmentation and reservation waste apart), and counts the page faults of the in-process
rank's forward passes (hooks on its model) and the decommits the plans carry; an engine that is
not recorded pays for none of it.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from block_manager import (
    ContiguousKVManager,
    KVCacheManager,
    KVManager,
    LayoutAccounting,
    LayoutUsage,
    VirtualKVManager,
)
from cluster.engine.config import EngineConfig
from cluster.engine.outputs import RequestOutput
from workers import ModelInfo
from workers.plan import StepOutput
from workers.virtual_pool import VirtualKVPool, virtual_geometry

if TYPE_CHECKING:
    from cluster.engine.engine_core import EngineCore


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


@dataclass(frozen=True)
class UsageSample:
    """One step's accounting, in bytes (all ranks together)."""

    time: float
    reserved_bytes: int
    backed_bytes: int
    live_bytes: int
    internal_fragmentation_bytes: int
    reservation_waste_bytes: int
    running_sequences: int


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@dataclass
class LayoutRecorder:
    """Per-step samples (kept only when `keep_samples`) plus running peaks and totals."""

    layout: str
    bytes_per_slot: float
    keep_samples: bool = False
    samples: list[UsageSample] = field(default_factory=list)
    peak_running_sequences: int = 0
    peak_backed_bytes: int = 0
    peak_live_bytes: int = 0
    sum_backed_bytes: float = 0.0
    sum_live_bytes: float = 0.0
    sum_reserved_bytes: float = 0.0
    sum_internal_fragmentation_bytes: float = 0.0
    sum_reservation_waste_bytes: float = 0.0
    num_samples: int = 0
    page_faults: int = 0
    """Minor page faults taken inside the rank's forward passes."""
    decommit_ranges: int = 0
    forward_seconds: float = 0.0
    measured_backed_bytes: list[tuple[float, int]] = field(default_factory=list)
    """(time, bytes) resident in the rank's virtual pool after each step (mincore), kept with
    `keep_samples`."""
    virtual_pool: VirtualKVPool | None = field(default=None, repr=False)
    _faults_before_forward: int = field(default=0, repr=False)

    @classmethod
    def of(cls, engine: EngineCore, keep_samples: bool = False) -> LayoutRecorder:
        """A recorder for `engine`'s layout (its bytes per token slot from the model), hooked
        to its in-process rank's model (backend "local": `getrusage` sees the rank's faults).
        Raises ValueError for ranks on Ray."""
        rank = engine.workers.local_rank
        if rank is None or rank.model is None:
            raise ValueError("the layouts recorder observes an in-process rank: backend 'local'")
        cache = engine.config.cache
        per_slot = engine.model_info.kv_bytes_per_block / cache.block_size
        recorder = cls(cache.kv_layout, per_slot, keep_samples, virtual_pool=rank.virtual_pool)
        rank.model.register_forward_pre_hook(recorder._forward_begins)
        rank.model.register_forward_hook(recorder._forward_ended)
        return recorder

    def _forward_begins(self, module: torch.nn.Module, args: Any) -> None:
        self._faults_before_forward = _minor_faults()

    def _forward_ended(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.page_faults += _minor_faults() - self._faults_before_forward

    def step(self, engine: EngineCore) -> list[RequestOutput]:
        """`engine.step()`, sampling the layout's memory once the step is scheduled and the
        rank's page faults, resident bytes and the plan's decommits once it ran."""
        step = engine.begin_step()
        running = sum(len(r.active_branches) for r in engine.scheduler.running)
        manager = engine.block_manager
        assert isinstance(manager, LayoutAccounting)
        self.observe(manager.usage(), running)
        result = engine.execute(step)
        if isinstance(result, StepOutput):
            self.observe_output(result, len(step.plan.decommit))
        return [request.make_output() for request in engine.finish_step(step, result)]

    def observe(self, usage: LayoutUsage, running_sequences: int) -> None:
        scale = self.bytes_per_slot
        sample = UsageSample(
            time=time.perf_counter(),
            reserved_bytes=round(usage.reserved_slots * scale),
            backed_bytes=round(usage.backed_slots * scale),
            live_bytes=round(usage.live_slots * scale),
            internal_fragmentation_bytes=round(usage.internal_fragmentation_slots * scale),
            reservation_waste_bytes=round(usage.reservation_waste_slots * scale),
            running_sequences=running_sequences,
        )
        if self.keep_samples:
            self.samples.append(sample)
        self.num_samples += 1
        self.peak_running_sequences = max(self.peak_running_sequences, running_sequences)
        self.peak_backed_bytes = max(self.peak_backed_bytes, sample.backed_bytes)
        self.peak_live_bytes = max(self.peak_live_bytes, sample.live_bytes)
        self.sum_backed_bytes += sample.backed_bytes
        self.sum_live_bytes += sample.live_bytes
        self.sum_reserved_bytes += sample.reserved_bytes
        self.sum_internal_fragmentation_bytes += sample.internal_fragmentation_bytes
        self.sum_reservation_waste_bytes += sample.reservation_waste_bytes

    def observe_output(self, output: StepOutput, decommit_ranges: int) -> None:
        self.forward_seconds += output.forward_seconds
        self.decommit_ranges += decommit_ranges
        if self.keep_samples and self.virtual_pool is not None:
            resident = self.virtual_pool.resident_bytes()
            self.measured_backed_bytes.append((time.perf_counter(), resident))

    def waste_fraction(self) -> float:
        """Time-averaged (backed - live) / backed over the sampled steps (0 when nothing backed)."""
        if self.sum_backed_bytes == 0:
            return 0.0
        return (self.sum_backed_bytes - self.sum_live_bytes) / self.sum_backed_bytes

    def utilization(self) -> float:
        """Time-averaged live / backed: 1 - `waste_fraction`."""
        return 1.0 - self.waste_fraction()
