"""Engine metrics: the block manager's pressure plus queue counts, preemptions and latencies."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from block_manager import PressureSnapshot, TierCounters
from cluster.engine.speculation import SpeculationCounters

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


@dataclass
class Histogram:
    """Cumulative-free bucket counts: `counts[i]` observations <= `bounds[i]`, not in earlier
    buckets; `counts[-1]` is the overflow (+Inf) bucket."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total, self.count)


@dataclass
class EngineMetrics:
    """A snapshot for the serving layer (and Prometheus)."""

    pressure: PressureSnapshot
    num_running: int
    num_waiting: int
    num_swapped: int
    preemptions_recompute: int
    preemptions_swap: int
    prefix_cache_hit_rate: float
    peak_kv_utilization: float
    peak_used_device_blocks: int
    num_steps: int
    num_generated_tokens: int
    num_finished_requests: int
    num_rejected_requests: int
    ttft_seconds: Histogram
    tpot_seconds: Histogram
    cache_tier: TierCounters = field(default_factory=TierCounters)
    """The CPU cache tier: hit tokens by tier, demoted / promoted blocks, refused swap-ins."""
    kv_bytes_to_cpu: int = 0
    """KV bytes copied device -> CPU (swap-outs and demotions)."""
    kv_bytes_to_device: int = 0
    """KV bytes copied CPU -> device (swap-ins and promotions)."""
    swap_checksum_failures: int = 0
    """Blocks whose bytes failed their checksum on the way back (`cache.verify_swaps`)."""
    num_aborted_requests: int = 0
    """Requests ended by their caller (a closed stream, a cancel, an abort) before finishing."""
    num_failed_requests: int = 0
    """Requests ended by a failed step attributed to them while the engine went on serving."""
    adapter_requests_total: dict[str, int] = field(default_factory=dict)
    """Requests admitted per LoRA adapter name (base-model requests are not counted here)."""
    adapter_generation_tokens_total: dict[str, int] = field(default_factory=dict)
    """Tokens generated per LoRA adapter name."""
    adapter_loads_total: int = 0
    """Adapters loaded into a device slot (every slot fill)."""
    adapter_evictions_total: int = 0
    """Adapters displaced from a device slot by another, plus adapters the CPU LRU dropped."""
    speculation: SpeculationCounters | None = None
    """Speculative decoding's drafts and accepted drafts (None: speculative decoding off)."""

    @property
    def preemptions(self) -> int:
        return self.preemptions_recompute + self.preemptions_swap


@dataclass
class MetricsRecorder:
    """What the engine accumulates step by step."""

    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    peak_kv_utilization: float = 0.0
    peak_used_device_blocks: int = 0
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_finished_requests: int = 0
    num_rejected_requests: int = 0
    swap_checksum_failures: int = 0
    num_aborted_requests: int = 0
    num_failed_requests: int = 0

    def observe_pressure(self, pressure: PressureSnapshot) -> None:
        if pressure.token_slots_allocated == 0:
            return
        self.peak_kv_utilization = max(self.peak_kv_utilization, pressure.kv_utilization)
        self.peak_used_device_blocks = max(self.peak_used_device_blocks, pressure.device.used)
