"""The Prometheus exposition, parsed back with prometheus_client's own text parser."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from block_manager import PressureSnapshot, TierCounters, TierPressure
from cluster.engine.metrics import LATENCY_BUCKETS_S, EngineMetrics, Histogram
from cluster.engine.speculation import SpeculationCounters
from cluster.serving.prometheus import PROMETHEUS_CONTENT_TYPE, render_prometheus


def snapshot(
    ttft: Sequence[float] = (),
    tpot: Sequence[float] = (),
    *,
    used: int = 6,
    swapped_out: int = 3,
) -> EngineMetrics:
    ttft_histogram, tpot_histogram = Histogram(), Histogram()
    for value in ttft:
        ttft_histogram.observe(value)
    for value in tpot:
        tpot_histogram.observe(value)
    pressure = PressureSnapshot(
        device=TierPressure(total=16, free=16 - used - 2, evictable_cached=2, used=used),
        cpu=TierPressure(total=8, free=5, evictable_cached=0, used=3),
        block_size=4,
        token_slots_allocated=used * 4,
        tokens_held=used * 4 - 3,
        waste_slots=3,
        num_sequences=2,
        num_swapped_sequences=1,
        prefix_query_tokens=40,
        prefix_hit_tokens=10,
        cow_copies=1,
        swap_out_blocks=swapped_out,
        swap_in_blocks=2,
        watermark_blocks=1,
    )
    return EngineMetrics(
        pressure=pressure,
        num_running=2,
        num_waiting=5,
        num_swapped=1,
        preemptions_recompute=4,
        preemptions_swap=1,
        prefix_cache_hit_rate=pressure.prefix_hit_rate,
        peak_kv_utilization=0.9,
        peak_used_device_blocks=used,
        num_steps=100,
        num_generated_tokens=250,
        num_finished_requests=7,
        num_rejected_requests=2,
        ttft_seconds=ttft_histogram,
        tpot_seconds=tpot_histogram,
    )


def parse(text: bytes) -> dict[str, list[Sample]]:
    """Samples by sample name (`..._bucket`, `..._total`, ...)."""
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Sample]], name: str, **labels: str) -> float:
    (match,) = [s for s in samples[name] if labels.items() <= s.labels.items()]
    return match.value


def test_kv_blocks_queues_prefix_preemptions_and_swaps_are_exposed() -> None:
    samples = parse(render_prometheus({"r0": snapshot()}))
    assert value(samples, "pagedserve_kv_cache_capacity_blocks", tier="device") == 16
    states = {
        state: value(samples, "pagedserve_kv_cache_blocks", tier="device", state=state)
        for state in ("free", "cached", "used")
    }
    assert states == {"free": 8, "cached": 2, "used": 6}
    assert value(samples, "pagedserve_kv_cache_usage_ratio", tier="device") == 6 / 16
    assert value(samples, "pagedserve_kv_cache_usage_ratio", tier="cpu") == 3 / 8
    assert value(samples, "pagedserve_kv_cache_slot_utilization_ratio") == 21 / 24
    assert value(samples, "pagedserve_sequences", queue="waiting") == 5
    assert value(samples, "pagedserve_sequences", queue="swapped") == 1
    assert value(samples, "pagedserve_prefix_cache_hit_ratio") == 0.25
    assert value(samples, "pagedserve_prefix_cache_hit_tokens_total") == 10
    assert value(samples, "pagedserve_preemptions_total", mode="recompute") == 4
    assert value(samples, "pagedserve_preemptions_total", mode="swap") == 1
    assert value(samples, "pagedserve_swapped_blocks_total", direction="out") == 3
    assert value(samples, "pagedserve_swapped_blocks_total", direction="in") == 2
    assert value(samples, "pagedserve_requests_total", outcome="rejected") == 2
    assert value(samples, "pagedserve_generated_tokens_total") == 250


def test_each_replica_is_its_own_labelled_series() -> None:
    text = render_prometheus({"a": snapshot(used=1), "b": snapshot(used=9, swapped_out=7)})
    samples = parse(text)
    used = {
        s.labels["replica"]: s.value
        for s in samples["pagedserve_kv_cache_blocks"]
        if s.labels["tier"] == "device" and s.labels["state"] == "used"
    }
    assert used == {"a": 1, "b": 9}
    assert value(samples, "pagedserve_swapped_blocks_total", replica="b", direction="out") == 7


def test_no_replicas_renders_families_without_samples() -> None:
    samples = parse(render_prometheus({}))
    assert samples == {}
    assert PROMETHEUS_CONTENT_TYPE.startswith("text/plain")


latencies = st.lists(
    st.one_of(st.sampled_from(LATENCY_BUCKETS_S), st.floats(0.0, 100.0, allow_nan=False)),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ttft=latencies, tpot=latencies)
def test_histograms_match_a_direct_count_of_the_observations(
    ttft: list[float], tpot: list[float]
) -> None:
    samples = parse(render_prometheus({"r": snapshot(ttft, tpot)}))
    for name, observed in (
        ("pagedserve_time_to_first_token_seconds", ttft),
        ("pagedserve_time_per_output_token_seconds", tpot),
    ):
        buckets = samples[f"{name}_bucket"]
        assert [s.labels["le"] for s in buckets][-1] == "+Inf"
        assert len(buckets) == len(LATENCY_BUCKETS_S) + 1
        for bucket in buckets:
            bound = math.inf if bucket.labels["le"] == "+Inf" else float(bucket.labels["le"])
            assert bucket.value == sum(1 for v in observed if v <= bound)
        assert value(samples, f"{name}_count") == len(observed)
        assert math.isclose(value(samples, f"{name}_sum"), sum(observed), abs_tol=1e-9)


def test_cache_tier_hits_moves_bytes_and_refusals_are_exposed() -> None:
    metrics = dataclasses.replace(
        snapshot(),
        cache_tier=TierCounters(
            device_hit_tokens=40,
            cpu_hit_tokens=24,
            demoted_blocks=9,
            promoted_blocks=6,
            refused_swap_ins=1,
        ),
        kv_bytes_to_cpu=9 * 1024,
        kv_bytes_to_device=6 * 1024,
        swap_checksum_failures=2,
    )
    samples = parse(render_prometheus({"r0": metrics}))
    hits = "pagedserve_prefix_cache_tier_hit_tokens_total"
    assert value(samples, hits, tier="device") == 40
    assert value(samples, hits, tier="cpu") == 24
    assert value(samples, "pagedserve_cache_tier_blocks_total", move="demoted") == 9
    assert value(samples, "pagedserve_cache_tier_blocks_total", move="promoted") == 6
    copied = "pagedserve_kv_copied_bytes_total"
    assert value(samples, copied, direction="to_cpu") == 9 * 1024
    assert value(samples, copied, direction="to_device") == 6 * 1024
    assert value(samples, "pagedserve_refused_swap_ins_total", reason="stale") == 1
    assert value(samples, "pagedserve_refused_swap_ins_total", reason="checksum") == 2


def test_adapter_requests_tokens_loads_and_evictions_are_exposed() -> None:
    metrics = dataclasses.replace(
        snapshot(),
        adapter_requests_total={"sql": 3, "chat": 1},
        adapter_generation_tokens_total={"sql": 30, "chat": 8},
        adapter_loads_total=4,
        adapter_evictions_total=2,
    )
    samples = parse(render_prometheus({"r0": metrics}))
    assert value(samples, "pagedserve_adapter_requests_total", adapter="sql") == 3
    assert value(samples, "pagedserve_adapter_requests_total", adapter="chat") == 1
    assert value(samples, "pagedserve_adapter_generation_tokens_total", adapter="sql") == 30
    assert value(samples, "pagedserve_adapter_loads_total", replica="r0") == 4
    assert value(samples, "pagedserve_adapter_evictions_total", replica="r0") == 2
    plain = parse(render_prometheus({"r0": snapshot()}))
    assert "pagedserve_adapter_requests_total" not in plain  # no adapter: no series
    assert value(plain, "pagedserve_adapter_loads_total", replica="r0") == 0


def test_speculative_decoding_counters_are_exposed() -> None:
    counters = SpeculationCounters(
        num_drafts=5, num_draft_tokens=14, num_accepted_tokens=9, accepted_per_position=[5, 3, 1]
    )
    samples = parse(
        render_prometheus({"r0": dataclasses.replace(snapshot(), speculation=counters)})
    )
    assert value(samples, "pagedserve_spec_decode_num_drafts_total", replica="r0") == 5
    assert value(samples, "pagedserve_spec_decode_num_draft_tokens_total", replica="r0") == 14
    assert value(samples, "pagedserve_spec_decode_num_accepted_tokens_total", replica="r0") == 9
    for position, count in enumerate([5, 3, 1]):
        name = "pagedserve_spec_decode_num_accepted_tokens_per_pos_total"
        assert value(samples, name, position=str(position)) == count
    plain = parse(render_prometheus({"r0": snapshot()}))
    assert "pagedserve_spec_decode_num_drafts_total" not in plain  # off: no series
