"""Prometheus families of KV pulls between replicas (`pagedserve_kv_transfer_*`), one sample
set per replica, from each snapshot's `EngineMetrics.kv_transfer` (replicas without a transfer
service add nothing).

- `pagedserve_kv_transfer_pulls` / `_blocks` / `_bytes{direction="in"|"out"}`: pulls this
  replica made and what they brought in, exports it served and what they sent out;
- `pagedserve_kv_transfer_seconds`: a pull's wall time, reservation to sealed blocks;
- `pagedserve_kv_transfer_fallbacks{cause}`: pulls that failed or stopped short and were
  computed (causes: `cluster.kv_transfer.payload.PullFailure`), and
  `pagedserve_kv_transfer_declined`: pulls the cost model turned down;
- `pagedserve_kv_transfer_bandwidth_bytes_per_second{holder}`: the smoothed measured bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from cluster.engine.metrics import EngineMetrics, Histogram
from cluster.kv_transfer.payload import PullFailure

PREFIX = "pagedserve_kv_transfer"


def kv_transfer_families(
    snapshots: Mapping[str, EngineMetrics],
    buckets: Callable[[Histogram], list[tuple[str, float]]],
) -> Iterator[Metric]:
    """`buckets`: `prometheus.cumulative_buckets` (passed in, so the import runs one way)."""
    pulls = CounterMetricFamily(
        f"{PREFIX}_pulls", "KV pulls from a peer replica that brought blocks", labels=["replica"]
    )
    exports = CounterMetricFamily(
        f"{PREFIX}_exports", "Pulls by a peer this replica answered", labels=["replica"]
    )
    blocks = CounterMetricFamily(
        f"{PREFIX}_blocks", "KV blocks moved between replicas", labels=["replica", "direction"]
    )
    moved = CounterMetricFamily(
        f"{PREFIX}_bytes", "KV bytes moved between replicas", labels=["replica", "direction"]
    )
    seconds = HistogramMetricFamily(
        f"{PREFIX}_seconds", "Wall time of a pull, reservation to sealed blocks", labels=["replica"]
    )
    fallbacks = CounterMetricFamily(
        f"{PREFIX}_fallbacks",
        "Pulls that failed or stopped short; their blocks were computed",
        labels=["replica", "cause"],
    )
    declined = CounterMetricFamily(
        f"{PREFIX}_declined",
        "Pulls the cost model turned down (computing predicted faster)",
        labels=["replica"],
    )
    bandwidth = GaugeMetricFamily(
        f"{PREFIX}_bandwidth_bytes_per_second",
        "Measured (smoothed) pull bandwidth from each holder",
        labels=["replica", "holder"],
    )
    for replica, metrics in snapshots.items():
        counters = metrics.kv_transfer
        if counters is None:
            continue
        pulls.add_metric([replica], counters.pulls)
        exports.add_metric([replica], counters.exports)
        blocks.add_metric([replica, "in"], counters.pulled_blocks)
        blocks.add_metric([replica, "out"], counters.exported_blocks)
        moved.add_metric([replica, "in"], counters.pulled_bytes)
        moved.add_metric([replica, "out"], counters.exported_bytes)
        histogram = counters.pull_seconds
        seconds.add_metric([replica], buckets=buckets(histogram), sum_value=histogram.total)
        for cause in PullFailure:
            fallbacks.add_metric([replica, cause.value], counters.fallbacks.get(cause.value, 0))
        declined.add_metric([replica], counters.declined)
        for holder, value in counters.bandwidth_bytes_per_s.items():
            bandwidth.add_metric([replica, holder], value)
    yield from (pulls, exports, blocks, moved, seconds, fallbacks, declined, bandwidth)
