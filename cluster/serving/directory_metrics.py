"""Prometheus exposition of the KV directory: entries per replica and tier, events per second,
query latency inside the directory and round trip from the ingress, resyncs and evictions.

Rendered next to the engine metrics on the ingress's /metrics; an unreachable directory
renders only the ingress's own figures (`pagedserve_kv_directory_up 0`).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cluster.serving.kv_directory import DirectoryClient, DirectoryReport

PREFIX = "pagedserve_kv_directory"


class DirectoryCollector(Collector):
    def __init__(self, report: DirectoryReport | None, client: DirectoryClient) -> None:
        self.report = report
        self.client = client

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}_up", "Whether the KV directory answered this scrape")
        up.add_metric([], 1.0 if self.report is not None else 0.0)
        yield up
        round_trips = sorted(self.client.round_trip_us)
        latency = GaugeMetricFamily(
            f"{PREFIX}_query_seconds",
            "Prefix query latency: inside the directory, and round trip from this ingress",
            labels=["where", "quantile"],
        )
        for quantile in (0.5, 0.99):
            if round_trips:
                index = min(len(round_trips) - 1, int(quantile * len(round_trips)))
                latency.add_metric(["round_trip", str(quantile)], round_trips[index] / 1e6)
        failures = CounterMetricFamily(
            f"{PREFIX}_query_failures", "Queries that failed or timed out (routed by load)"
        )
        failures.add_metric([], float(self.client.failures))
        yield failures
        report = self.report
        if report is None:
            yield latency
            return
        latency.add_metric(["directory", "0.5"], report.query_us_p50 / 1e6)
        latency.add_metric(["directory", "0.99"], report.query_us_p99 / 1e6)
        yield latency
        stats = report.stats
        entries = GaugeMetricFamily(f"{PREFIX}_entries", "Block hashes indexed")
        entries.add_metric([], float(stats.entries))
        yield entries
        by_replica = GaugeMetricFamily(
            f"{PREFIX}_replica_entries",
            "Block hashes indexed per engine replica and tier",
            labels=["replica", "tier"],
        )
        for replica, tiers in stats.entries_by_replica.items():
            for tier, count in tiers.items():
                by_replica.add_metric([replica, tier], float(count))
        yield by_replica
        rate = GaugeMetricFamily(f"{PREFIX}_events_per_second", "Block events applied per second")
        rate.add_metric([], report.events_per_s)
        yield rate
        yield from _transfer_families(report)
        for name, value, doc in (
            ("events", stats.events_applied, "Block events applied"),
            ("snapshots", stats.snapshots, "Full snapshots applied (resyncs and joins)"),
            ("resyncs_requested", stats.resyncs_requested, "Batches refused for a sequence gap"),
            ("evicted_entries", stats.evicted_entries, "Entries dropped by the entry bound"),
        ):
            counter = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            counter.add_metric([], float(value))
            yield counter


def _transfer_families(report: DirectoryReport) -> Iterator[Metric]:
    """The cluster's KV pulls by (holder, receiver) replica pair, as receivers reported them."""
    families = {
        "pulls": CounterMetricFamily(
            f"{PREFIX}_transfers", "KV pulls between replicas", labels=["holder", "receiver"]
        ),
        "blocks": CounterMetricFamily(
            f"{PREFIX}_transfer_blocks", "KV blocks pulled", labels=["holder", "receiver"]
        ),
        "bytes": CounterMetricFamily(
            f"{PREFIX}_transfer_bytes", "KV bytes pulled", labels=["holder", "receiver"]
        ),
    }
    for (holder, receiver), tally in report.transfers.items():
        for field_name, family in families.items():
            family.add_metric([holder, receiver], float(getattr(tally, field_name)))
    yield from families.values()


def render_directory(report: DirectoryReport | None, client: DirectoryClient) -> bytes:
    """Prometheus text exposition (format 0.0.4), to append to the engines' exposition."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DirectoryCollector(report, client))
    return generate_latest(registry)
