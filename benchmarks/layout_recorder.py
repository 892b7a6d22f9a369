"""`LayoutRecorder`: the layouts benchmark's view of an engine's KV memory, step by step.

It runs an engine's steps (`LayoutRecorder.step`, in place of `EngineCore.step`) and samples, at
each, bytes reserved, bytes physically backed and bytes holding live tokens (plus internal
fragmentation and reservation waste apart), and counts the page faults of the in-process rank's
forward passes (hooks on its model) and the ranges its pool handed back to the OS; an engine that
is not recorded pays for none of it.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from block_manager import LayoutAccounting, LayoutUsage
from cluster.engine.outputs import RequestOutput
from workers.plan import StepOutput
from workers.rank import WorkerRank

if TYPE_CHECKING:
    from cluster.engine.engine_core import EngineCore


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
    forward_seconds: float = 0.0
    measured_backed_bytes: list[tuple[float, int]] = field(default_factory=list)
    """(time, bytes) resident in the rank's device pool after each step, kept with `keep_samples`
    when its layout measures them (the virtual layout's mincore)."""
    rank: WorkerRank | None = field(default=None, repr=False)
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
        recorder = cls(cache.kv_layout, per_slot, keep_samples, rank=rank)
        rank.model.register_forward_pre_hook(recorder._forward_begins)
        rank.model.register_forward_hook(recorder._forward_ended)
        return recorder

    def _forward_begins(self, module: torch.nn.Module, args: Any) -> None:
        self._faults_before_forward = _minor_faults()

    def _forward_ended(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.page_faults += _minor_faults() - self._faults_before_forward

    def step(self, engine: EngineCore) -> list[RequestOutput]:
        """`engine.step()`, sampling the layout's memory once the step is scheduled and the
        rank's page faults and resident bytes once it ran."""
        step = engine.begin_step()
        running = sum(len(r.active_branches) for r in engine.scheduler.running)
        manager = engine.block_manager
        assert isinstance(manager, LayoutAccounting)
        self.observe(manager.usage(), running)
        result = engine.execute(step)
        if isinstance(result, StepOutput):
            self.observe_output(result)
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

    @property
    def decommit_ranges(self) -> int:
        """Ranges the rank's pool handed back to the OS so far (the virtual layout's released
        slots; 0 for the others)."""
        return 0 if self.rank is None else self.rank.kv_pool.returned_ranges

    def observe_output(self, output: StepOutput) -> None:
        self.forward_seconds += output.forward_seconds
        if not self.keep_samples or self.rank is None:
            return
        resident = self.rank.resident_bytes()
        if resident is not None:
            self.measured_backed_bytes.append((time.perf_counter(), resident))

    def waste_fraction(self) -> float:
        """Time-averaged (backed - live) / backed over the sampled steps (0 when nothing backed)."""
        if self.sum_backed_bytes == 0:
            return 0.0
        return (self.sum_backed_bytes - self.sum_live_bytes) / self.sum_backed_bytes

    def utilization(self) -> float:
        """Time-averaged live / backed: 1 - `waste_fraction`."""
        return 1.0 - self.waste_fraction()
