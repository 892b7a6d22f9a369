"""Prometheus family of hybrid KV groups' blocks (`pagedserve_kv_cache_group_blocks`), one
sample set per replica and group, from each snapshot's `EngineMetrics.kv_groups` (replicas
whose layers all keep every block add nothing).

Labels: `group` (the group's index, the workers' order), `window` (its sliding window in
tokens, `full` for full attention) and `state`: `used` (referenced by the group's tables),
`cached` (unreferenced, still hit-able in that group) and `free` (the shared pool's free
blocks, the same for every group: any group may take them). Summed over groups, used and
cached give the device tier's `pagedserve_kv_cache_blocks`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric

from cluster.engine.metrics import EngineMetrics

NAME = "pagedserve_kv_cache_group_blocks"


def kv_group_families(snapshots: Mapping[str, EngineMetrics]) -> Iterator[Metric]:
    blocks = GaugeMetricFamily(
        NAME,
        "Device KV blocks of a hybrid KV group by state: used, cached (unreferenced but "
        "hit-able), free (the shared pool's)",
        labels=["replica", "group", "window", "state"],
    )
    for replica, m in snapshots.items():
        for usage in m.kv_groups:
            labels = [
                replica,
                str(usage.group),
                "full" if usage.window is None else str(usage.window),
            ]
            blocks.add_metric([*labels, "used"], usage.used)
            blocks.add_metric([*labels, "cached"], usage.cached)
            blocks.add_metric([*labels, "free"], usage.free)
    yield blocks
