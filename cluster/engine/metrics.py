"""Engine metrics: the block manager's pressure plus queue counts, preemptions and latencies."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from block_manager import PressureSnapshot, TierCounters
from block_manager.hybrid_views import GroupedKV, GroupUsage
from cluster.engine.outputs import RequestMetrics
from cluster.engine.speculation import SpeculationCounters

if TYPE_CHECKING:
    from block_manager import KVManager
    from cluster.engine.engine_lora import EngineAdapters
    from cluster.engine.scheduler import Scheduler
    from cluster.kv_transfer.metrics import TransferCounters

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
    kv_transfer: TransferCounters | None = None
    """KV pulls to and from peer replicas (None: no transfer service attached)."""
    kv_groups: tuple[GroupUsage, ...] = ()
    """Hybrid KV groups (`block_manager.hybrid`): each group's used and cached-evictable
    blocks and the pool's free ones (empty when every layer keeps every block)."""

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

    def observe_tokens(self, metrics: RequestMetrics, now: float, new_tokens: int) -> None:
        """A step added `new_tokens` to one request at `now`: TTFT at its first token; after
        it, the step's time shared by the tokens it added (a speculative step adds several),
        one time per token."""
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self.ttft.observe(now - metrics.arrival_time)
            new_tokens -= 1
        last = metrics.last_token_time
        if last is not None and new_tokens > 0:
            per_token = (now - last) / new_tokens
            observe = self.tpot.observe
            for _ in range(new_tokens):
                metrics.inter_token_times.append(per_token)
                observe(per_token)
        metrics.last_token_time = now


def collect_metrics(
    recorder: MetricsRecorder,
    scheduler: Scheduler,
    block_manager: KVManager,
    adapters: EngineAdapters,
    *,
    kv_bytes_per_block: int,
) -> EngineMetrics:
    """One consistent snapshot of the engine's counters (read between steps)."""
    pressure = block_manager.pressure()
    tier = TierCounters() if scheduler.tier is None else scheduler.tier.tier_counters()
    return EngineMetrics(
        pressure=pressure,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped),
        preemptions_recompute=scheduler.preemptions.recompute,
        preemptions_swap=scheduler.preemptions.swap,
        prefix_cache_hit_rate=pressure.prefix_hit_rate,
        peak_kv_utilization=recorder.peak_kv_utilization,
        peak_used_device_blocks=recorder.peak_used_device_blocks,
        num_steps=recorder.num_steps,
        num_generated_tokens=recorder.num_generated_tokens,
        num_finished_requests=recorder.num_finished_requests,
        num_rejected_requests=recorder.num_rejected_requests,
        num_aborted_requests=recorder.num_aborted_requests,
        num_failed_requests=recorder.num_failed_requests,
        ttft_seconds=recorder.ttft.copy(),
        tpot_seconds=recorder.tpot.copy(),
        cache_tier=tier,
        kv_bytes_to_cpu=(pressure.swap_out_blocks + tier.demoted_blocks) * kv_bytes_per_block,
        kv_bytes_to_device=(pressure.swap_in_blocks + tier.promoted_blocks) * kv_bytes_per_block,
        swap_checksum_failures=recorder.swap_checksum_failures,
        adapter_requests_total=dict(adapters.counts.requests),
        adapter_generation_tokens_total=dict(adapters.counts.tokens),
        adapter_loads_total=adapters.loads,
        adapter_evictions_total=adapters.evictions,
        speculation=scheduler.speculation_counters(),
        kv_groups=(
            tuple(block_manager.group_usage()) if isinstance(block_manager, GroupedKV) else ()
        ),
    )
