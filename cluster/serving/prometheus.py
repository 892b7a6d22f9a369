"""Prometheus exposition of engine metrics: a custom collector over `EngineMetrics` snapshots.

`render_prometheus` turns one snapshot per replica into Prometheus' text format, each sample
labelled with its `replica`. Nothing is registered globally: every render builds its own registry,
so a scrape always reflects the snapshots passed in and nothing else.

Invariants of the exposition:
- block gauges per tier satisfy `free + cached + used == capacity` (as the block manager's
  `TierPressure` does);
- histogram buckets are cumulative, end with `+Inf`, and the `+Inf` bucket equals `_count`;
- counters are the engine's cumulative counts since it started (they never decrease while the
  engine lives).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from cluster.engine.metrics import EngineMetrics, Histogram
from cluster.serving.kv_group_metrics import kv_group_families
from cluster.serving.kv_transfer_metrics import kv_transfer_families

PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "pagedserve"

SnapshotSource = Callable[[], Mapping[str, EngineMetrics]]
"""Returns the current snapshot of each replica, keyed by replica id."""


def cumulative_buckets(histogram: Histogram) -> list[tuple[str, float]]:
    """Prometheus buckets `(le, observations <= le)` from the engine's per-bucket counts."""
    buckets: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip(histogram.bounds, histogram.counts, strict=False):
        running += count
        buckets.append((repr(float(bound)), float(running)))
    buckets.append(("+Inf", float(histogram.count)))
    return buckets


class EngineMetricsCollector(Collector):
    """Yields one family per metric with one sample (set) per replica on every `collect()`."""

    def __init__(self, source: SnapshotSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        snapshots = self._source()
        yield from self._blocks(snapshots)
        yield from self._queues(snapshots)
        yield from self._prefix_cache(snapshots)
        yield from self._preemption_and_swaps(snapshots)
        yield from self._cache_tiers(snapshots)
        yield from self._throughput(snapshots)
        yield from self._adapters(snapshots)
        yield from self._speculation(snapshots)
        yield from self._latency(snapshots)
        yield from kv_transfer_families(snapshots, cumulative_buckets)
        yield from kv_group_families(snapshots)

    def _blocks(self, snapshots: Mapping[str, EngineMetrics]) -> Iterator[Metric]:
        capacity = GaugeMetricFamily(
            f"{PREFIX}_kv_cache_capacity_blocks",
            "KV cache blocks in a tier",
            labels=["replica", "tier"],
        )
        blocks = GaugeMetricFamily(
            f"{PREFIX}_kv_cache_blocks",
            "KV cache blocks by state: free, cached (unreferenced but hit-able), used",
            labels=["replica", "tier", "state"],
        )
        usage = GaugeMetricFamily(
            f"{PREFIX}_kv_cache_usage_ratio",
            "Fraction of a tier's blocks referenced by sequences",
            labels=["replica", "tier"],
        )
        slot_use = GaugeMetricFamily(
            f"{PREFIX}_kv_cache_slot_utilization_ratio",
            "Device token slots holding a token over slots allocated (1 - internal waste)",
            labels=["replica"],
        )
        waste = GaugeMetricFamily(
            f"{PREFIX}_kv_cache_waste_slots",
            "Allocated device token slots holding no token (partial tail blocks)",
            labels=["replica"],
        )
        for replica, m in snapshots.items():
            for tier_name, tier in (("device", m.pressure.device), ("cpu", m.pressure.cpu)):
                capacity.add_metric([replica, tier_name], tier.total)
                blocks.add_metric([replica, tier_name, "free"], tier.free)
                blocks.add_metric([replica, tier_name, "cached"], tier.evictable_cached)
                blocks.add_metric([replica, tier_name, "used"], tier.used)
                usage.add_metric([replica, tier_name], tier.used / tier.total if tier.total else 0)
            slot_use.add_metric([replica], m.pressure.kv_utilization)
            waste.add_metric([replica], m.pressure.waste_slots)
        yield from (capacity, blocks, usage, slot_use, waste)

    def _queues(self, snapshots: Mapping[str, EngineMetrics]) -> Iterator[Metric]:
        requests = GaugeMetricFamily(
            f"{PREFIX}_sequences",
            "Sequence groups by scheduler queue: running, waiting (admission), swapped (CPU tier)",
            labels=["replica", "queue"],
        )
        for replica, m in snapshots.items():
            requests.add_metric([replica, "running"], m.num_running)
            requests.add_metric([replica, "waiting"], m.num_waiting)
            requests.add_metric([replica, "swapped"], m.num_swapped)
        yield requests

    def _prefix_cache(self, snapshots: Mapping[str, EngineMetrics]) -> Iterator[Metric]:
        hit_rate = GaugeMetricFamily(
            f"{PREFIX}_prefix_cache_hit_ratio",
            "Prompt tokens found in the prefix cache over prompt tokens looked up",
            labels=["replica"],
        )
        queried = CounterMetricFamily(
            f"{PREFIX}_prefix_cache_query_tokens",
            "Prompt tokens looked up in the prefix cache",
            labels=["replica"],
        )
        hits = CounterMetricFamily(
            f"{PREFIX}_prefix_cache_hit_tokens",
            "Prompt tokens whose KV came from the prefix cache",
            labels=["replica"],
        )
        for replica, m in snapshots.items():
            hit_rate.add_metric([replica], m.prefix_cache_hit_rate)
            queried.add_metric([replica], m.pressure.prefix_query_tokens)
            hits.add_metric([replica], m.pressure.prefix_hit_tokens)
        yield from (hit_rate, queried, hits)

    def _preemption_and_swaps(self, snapshots: Mapping[str, EngineMetrics]) -> Iterator[Metric]:
        preemptions = CounterMetricFamily(
            f"{PREFIX}_preemptions",
            "Sequence groups preempted, by mode (recompute drops KV, swap moves it to CPU)",
            labels=["replica", "mode"],
        )
        swapped = CounterMetricFamily(
            f"{PREFIX}_swapped_blocks",
            "KV blocks copied between the device and the CPU tier",
            labels=["replica", "direction"],
        )
        cow = CounterMetricFamily(
            f"{PREFIX}_copy_on_write_blocks",
            "Shared tail blocks copied before a write",
            labels=["replica"],
        )
        for replica, m in snapshots.items():
            preemptions.add_metric([replica, "recompute"], m.preemptions_recompute)
            preemptions.add_metric([replica, "swap"], m.preemptions_swap)
            swapped.add_metric([replica, "out"], m.pressure.swap_out_blocks)
            swapped.add_metric([replica, "in"], m.pressure.swap_in_blocks)
            cow.add_metric([replica], m.pressure.cow_copies)
        yield from (preemptions, swapped, cow)

    def _cache_tiers(self, snapshots: Mapping[str, EngineMetrics]) -> Iterator[Metric]:
        hits = CounterMetricFamily(
            f"{PREFIX}_prefix_cache_tier_hit_tokens",
            "Prompt tokens found in the prefix cache, by the tier that held them",
            labels=["replica", "tier"],
        )
        moved = CounterMetricFamily(
            f"{PREFIX}_cache_tier_blocks",
            "Cached blocks moved between tiers: demoted (device -> CPU before reuse) or "
            "promoted (CPU -> device on a hit)",
            labels=["replica", "move"],
        )
        copied = CounterMetricFamily(
            f"{PREFIX}_kv_copied_bytes",
            "KV bytes copied between the device and the CPU (swaps and tier moves)",
            labels=["replica", "direction"],
        )
        refused = CounterMetricFamily(
            f"{PREFIX}_refused_swap_ins",
            "Copies back from the CPU refused: stale generation, or checksum mismatch",
            labels=["replica", "reason"],
        )
        for replica, m in snapshots.items():
            tier = m.cache_tier
            hits.add_metric([replica, "device"], tier.device_hit_tokens)
            hits.add_metric([replica, "cpu"], tier.cpu_hit_tokens)
            moved.add_metric([replica, "demoted"], tier.demoted_blocks)
            moved.add_metric([replica, "promoted"], tier.promoted_blocks)
            copied.add_metric([replica, "to_cpu"], m.kv_bytes_to_cpu)
            copied.add_metric([replica, "to_device"], m.kv_bytes_to_device)
            refused.add_metric([replica, "stale"], tier.refused_swap_ins)
            refused.add_metric([replica, "checksum"], m.swap_checksum_failures)
        yield from (hits, moved, copied, refused)

    def _throughput(self, snapshots: Mapping[str, EngineMetrics]) -> Iterator[Metric]:
        steps = CounterMetricFamily(f"{PREFIX}_steps", "Engine steps run", labels=["replica"])
        tokens = CounterMetricFamily(
            f"{PREFIX}_generated_tokens", "Tokens sampled", labels=["replica"]
        )
        requests = CounterMetricFamily(
            f"{PREFIX}_requests",
            "Requests that left the engine, by outcome",
            labels=["replica", "outcome"],
        )
        for replica, m in snapshots.items():
            steps.add_metric([replica], m.num_steps)
            tokens.add_metric([replica], m.num_generated_tokens)
            requests.add_metric([replica, "finished"], m.num_finished_requests)
            requests.add_metric([replica, "rejected"], m.num_rejected_requests)
            requests.add_metric([replica, "aborted"], m.num_aborted_requests)
            requests.add_metric([replica, "failed"], m.num_failed_requests)
        yield from (steps, tokens, requests)

    def _adapters(self, snapshots: Mapping[str, EngineMetrics]) -> Iterator[Metric]:
        """LoRA: requests and generated tokens per adapter name, adapter loads (slot fills)
        and evictions (displaced from a slot, or dropped by the CPU LRU)."""
        requests = CounterMetricFamily(
            f"{PREFIX}_adapter_requests",
            "Requests admitted for a LoRA adapter",
            labels=["replica", "adapter"],
        )
        tokens = CounterMetricFamily(
            f"{PREFIX}_adapter_generation_tokens",
            "Tokens sampled for requests of a LoRA adapter",
            labels=["replica", "adapter"],
        )
        loads = CounterMetricFamily(
            f"{PREFIX}_adapter_loads",
            "LoRA adapters loaded into a device slot",
            labels=["replica"],
        )
        evictions = CounterMetricFamily(
            f"{PREFIX}_adapter_evictions",
            "LoRA adapters displaced from a device slot or dropped from CPU memory",
            labels=["replica"],
        )
        for replica, m in snapshots.items():
            for adapter, count in sorted(m.adapter_requests_total.items()):
                requests.add_metric([replica, adapter], count)
            for adapter, count in sorted(m.adapter_generation_tokens_total.items()):
                tokens.add_metric([replica, adapter], count)
            loads.add_metric([replica], m.adapter_loads_total)
            evictions.add_metric([replica], m.adapter_evictions_total)
        yield from (requests, tokens, loads, evictions)

    def _speculation(self, snapshots: Mapping[str, EngineMetrics]) -> Iterator[Metric]:
        """Speculative decoding, as vLLM names it: verification steps with drafts, drafts,
        accepted drafts, and accepted drafts by position (no series with speculation off)."""
        drafts = CounterMetricFamily(
            f"{PREFIX}_spec_decode_num_drafts",
            "Decodes that carried speculative drafts",
            labels=["replica"],
        )
        draft_tokens = CounterMetricFamily(
            f"{PREFIX}_spec_decode_num_draft_tokens", "Drafts proposed", labels=["replica"]
        )
        accepted = CounterMetricFamily(
            f"{PREFIX}_spec_decode_num_accepted_tokens", "Drafts accepted", labels=["replica"]
        )
        per_position = CounterMetricFamily(
            f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted at each position of a decode's drafts (0-based)",
            labels=["replica", "position"],
        )
        for replica, m in snapshots.items():
            counters = m.speculation
            if counters is None:
                continue
            drafts.add_metric([replica], counters.num_drafts)
            draft_tokens.add_metric([replica], counters.num_draft_tokens)
            accepted.add_metric([replica], counters.num_accepted_tokens)
            for position, count in enumerate(counters.accepted_per_position):
                per_position.add_metric([replica, str(position)], count)
        yield from (drafts, draft_tokens, accepted, per_position)

    def _latency(self, snapshots: Mapping[str, EngineMetrics]) -> Iterator[Metric]:
        ttft = HistogramMetricFamily(
            f"{PREFIX}_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token",
            labels=["replica"],
        )
        tpot = HistogramMetricFamily(
            f"{PREFIX}_time_per_output_token_seconds",
            "Seconds between consecutive output tokens of a sequence",
            labels=["replica"],
        )
        for replica, m in snapshots.items():
            for family, histogram in ((ttft, m.ttft_seconds), (tpot, m.tpot_seconds)):
                family.add_metric(
                    [replica], buckets=cumulative_buckets(histogram), sum_value=histogram.total
                )
        yield from (ttft, tpot)


def render_prometheus(snapshots: Mapping[str, EngineMetrics]) -> bytes:
    """Prometheus text exposition (format 0.0.4) of the given replicas' snapshots."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineMetricsCollector(lambda: snapshots))
    return generate_latest(registry)
