"""Counters of KV transfers on one replica, as either end of a pull (what /metrics exports as
`pagedserve_kv_transfer_*`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from cluster.engine.metrics import Histogram

TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class TransferCounters:
    """Cumulative: pulls this replica made (and their blocks, bytes, latency), pulls it declined
    because computing was cheaper, pulls that fell back to computing by cause, exports it served
    to peers, and the bandwidth it measured per holder."""

    pulls: int = 0
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    pull_seconds: Histogram = field(default_factory=lambda: Histogram(TRANSFER_BUCKETS_S))
    declined: int = 0
    """Pulls the cost model turned down (computing the tokens was predicted faster)."""
    fallbacks: dict[str, int] = field(default_factory=dict)
    """Pulls that failed (or stopped short) and were computed instead, by `PullFailure`."""
    exports: int = 0
    exported_blocks: int = 0
    exported_bytes: int = 0
    bandwidth_bytes_per_s: dict[str, float] = field(default_factory=dict)
    """The measured (smoothed) pull bandwidth from each holder."""

    def fallback(self, cause: str) -> None:
        self.fallbacks[cause] = self.fallbacks.get(cause, 0) + 1

    def snapshot(self) -> TransferCounters:
        return copy.deepcopy(self)
