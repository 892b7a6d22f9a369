"""`pagedserve_kv_transfer_*` and the directory's transfer tally, parsed back with
prometheus_client's own parser."""

from __future__ import annotations

import dataclasses

from cluster.kv_transfer.metrics import TransferCounters
from cluster.kv_transfer.payload import PullFailure
from cluster.serving.directory_index import DirectoryStats
from cluster.serving.directory_metrics import render_directory
from cluster.serving.kv_directory import DirectoryClient, DirectoryReport, TransferTally
from cluster.serving.prometheus import render_prometheus
from tests.serving.test_prometheus import parse, snapshot, value


def test_transfer_counters_are_exposed_per_replica() -> None:
    counters = TransferCounters(pulls=3, pulled_blocks=40, pulled_bytes=4000, declined=2)
    counters.exports, counters.exported_blocks, counters.exported_bytes = 5, 60, 6000
    for seconds in (0.004, 0.03, 0.2):
        counters.pull_seconds.observe(seconds)
    counters.fallback(PullFailure.CHECKSUM)
    counters.fallback(PullFailure.TIMEOUT)
    counters.fallback(PullFailure.TIMEOUT)
    counters.bandwidth_bytes_per_s["holder-a"] = 1.5e8
    with_transfers = dataclasses.replace(snapshot(), kv_transfer=counters)
    samples = parse(render_prometheus({"r1": with_transfers, "r2": snapshot()}))
    prefix = "pagedserve_kv_transfer"
    assert value(samples, f"{prefix}_pulls_total", replica="r1") == 3
    assert value(samples, f"{prefix}_exports_total", replica="r1") == 5
    assert value(samples, f"{prefix}_blocks_total", replica="r1", direction="in") == 40
    assert value(samples, f"{prefix}_bytes_total", replica="r1", direction="out") == 6000
    assert value(samples, f"{prefix}_seconds_count", replica="r1") == 3
    assert value(samples, f"{prefix}_seconds_bucket", replica="r1", le="0.05") == 2
    assert value(samples, f"{prefix}_fallbacks_total", replica="r1", cause="timeout") == 2
    assert value(samples, f"{prefix}_fallbacks_total", replica="r1", cause="not_held") == 0
    assert value(samples, f"{prefix}_declined_total", replica="r1") == 2
    assert value(samples, f"{prefix}_bandwidth_bytes_per_second", holder="holder-a") == 1.5e8
    assert not [s for s in samples[f"{prefix}_pulls_total"] if s.labels["replica"] == "r2"]


def test_the_directory_shows_pulls_by_replica_pair() -> None:
    stats = DirectoryStats(0, 10, {}, {}, 0, 0, 0, 0)
    report = DirectoryReport(
        stats, 0.0, 1.0, 2.0, 0, transfers={("a", "b"): TransferTally(2, 30, 3000)}
    )
    samples = parse(render_directory(report, DirectoryClient(None, 0.1)))
    prefix = "pagedserve_kv_directory"
    assert value(samples, f"{prefix}_transfers_total", holder="a", receiver="b") == 2
    assert value(samples, f"{prefix}_transfer_blocks_total", holder="a", receiver="b") == 30
    assert value(samples, f"{prefix}_transfer_bytes_total", holder="a", receiver="b") == 3000
