"""Prefix-aware request routing across replicas, through Ray Serve's own extension point (a
custom `RequestRouter`, set with `request_router_config` on the deployment).

The ingress asks the KV directory which engine replicas hold how many leading blocks of the
prompt's hash chain and passes the answer as the `prefix_blocks` keyword of the handle call (the
chain itself travels on the request: `GenerateRequest.block_hashes`). The request goes to the
replica that holds the longest prefix, unless that replica is overloaded; a request whose prefix
no replica holds goes to the less busy of the two least loaded replicas. The directory is the one
source of what replicas hold; the router adds only where it has just sent a chain
(`PrefixIndex.record`), so a repeat that arrives before the replica's next event batch reaches the
directory follows it. Replicas report their load through Serve's routing stats
(`record_routing_stats`, see `routing_stats`).

Invariants:
- the choice only ranks replicas: Serve still probes queue lengths and moves on to the next rank
  when a replica is full, so routing never makes a request fail;
- a replica is overloaded when its ongoing requests reach `overload_fraction` of its
  `max_ongoing_requests`, when its engine has `max_waiting` requests waiting, or when its KV
  cache is used beyond `max_kv_utilization`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.engine.metrics import EngineMetrics
from cluster.serving.autoscaling import kv_used_fraction
from cluster.serving.prefix_index import PrefixIndex

PREFIX_BLOCKS_KWARG = "prefix_blocks"
TARGET_REPLICA_KWARG = "target_replica"
"""A call naming one replica (a peer pulling KV blocks from their holder) goes there first."""
ROUTER_CLASS_PATH = "cluster.serving.routing:PrefixAwareRouter"


@dataclass(frozen=True)
class LoadReport:
    """The load figures a replica publishes next to its block hashes; `kv_utilization` is the
    fraction of device blocks referenced (`kv_used_fraction`)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_utilization: float = 0.0

    @classmethod
    def of(cls, metrics: EngineMetrics) -> LoadReport:
        return cls(metrics.num_running, metrics.num_waiting, kv_used_fraction(metrics.pressure))


def routing_stats(load: LoadReport) -> dict[str, Any]:
    """What `record_routing_stats` returns: Serve hands it to every router as `routing_stats`."""
    return {"load": load}


@dataclass(frozen=True)
class RoutingPolicy:
    """The thresholds of `PrefixAwareRouter` (its `request_router_kwargs`)."""

    max_indexed_blocks: int = 16384
    overload_fraction: float = 0.75
    max_waiting: int = 4
    max_kv_utilization: float = 0.95

    def __post_init__(self) -> None:
        if self.max_indexed_blocks < 1:
            raise ValueError(f"max_indexed_blocks must be >= 1, got {self.max_indexed_blocks}")
        if not 0.0 < self.overload_fraction <= 1.0:
            raise ValueError(f"overload_fraction must be in (0, 1], got {self.overload_fraction}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if not 0.0 < self.max_kv_utilization <= 1.0:
            raise ValueError(f"max_kv_utilization must be in (0, 1], got {self.max_kv_utilization}")


@dataclass(frozen=True)
class ReplicaView:
    """What the choice needs to know of one replica."""

    replica: Any
    ongoing: int
    max_ongoing: int
    load: LoadReport

    def overloaded(self, policy: RoutingPolicy) -> bool:
        return (
            self.ongoing >= max(1, int(policy.overload_fraction * self.max_ongoing))
            or self.load.num_waiting >= policy.max_waiting
            or self.load.kv_utilization >= policy.max_kv_utilization
        )

    def busyness(self) -> int:
        return self.ongoing + self.load.num_running + self.load.num_waiting


def rank_replicas(
    views: list[ReplicaView],
    prefix_blocks: dict[Any, int],
    policy: RoutingPolicy,
    rng: random.Random,
) -> list[list[Any]]:
    """Ranks for Serve: the not-overloaded replica with the longest held prefix (ties: the less
    busy) alone first; without one, the two least busy replicas (Serve probes both and takes the
    shorter queue, as its power-of-two router does); then all the others, least busy first.
    """
    if not views:
        return []
    order = sorted(views, key=lambda v: (v.busyness(), rng.random()))
    usable = [v for v in order if not v.overloaded(policy)]
    holders = [v for v in usable if prefix_blocks.get(v.replica, 0) > 0]
    if holders:
        first = [max(holders, key=lambda v: (prefix_blocks[v.replica], -v.busyness()))]
    else:
        first = (usable or order)[:2]
    rest = [v.replica for v in order if v not in first]
    return [[v.replica for v in first], rest] if rest else [[v.replica for v in first]]


class PrefixAwareRouter(RequestRouter):
    """Serve request router: longest held prefix first, unless overloaded (see module doc)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = RoutingPolicy(**kwargs)
        self.recent = PrefixIndex(self.policy.max_indexed_blocks)
        """Where this router just sent each chain (until the directory learns of it)."""
        self._rng = random.Random()
        self._known: set[ReplicaID] = set()

    def _forget_gone(self, candidates: list[RunningReplica]) -> None:
        live = {c.replica_id for c in candidates}
        for gone in self._known - live:
            self.recent.forget(gone)
        self._known = live

    def _view(self, candidate: RunningReplica) -> ReplicaView:
        ongoing = self.replica_queue_len_cache.get(candidate.replica_id) or 0
        load = (candidate.routing_stats or {}).get("load", LoadReport())
        return ReplicaView(candidate.replica_id, ongoing, candidate.max_ongoing_requests, load)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        self._forget_gone(candidate_replicas)
        target = pending_request.kwargs.get(TARGET_REPLICA_KWARG) if pending_request else None
        if target is not None:
            named = [c for c in candidate_replicas if c.replica_id.unique_id == target]
            if named:
                return [named]
        hashes = request_block_hashes(pending_request)
        prefix = self.recent.longest_prefixes(hashes) if hashes else {}
        held = request_prefix_blocks(pending_request)
        for candidate in candidate_replicas:
            blocks = held.get(candidate.replica_id.unique_id, 0)
            if blocks > prefix.get(candidate.replica_id, 0):
                prefix[candidate.replica_id] = blocks
        by_id = {c.replica_id: c for c in candidate_replicas}
        views = [self._view(c) for c in candidate_replicas]
        ranks = rank_replicas(views, prefix, self.policy, self._rng)
        return [[by_id[rid] for rid in rank] for rank in ranks if rank]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        hashes = request_block_hashes(pending_request)
        if hashes:
            self.recent.record(replica_id, hashes)


def request_prefix_blocks(pending_request: PendingRequest | None) -> dict[str, int]:
    """The directory's answer the ingress attached: replica id -> leading blocks it holds."""
    if pending_request is None:
        return {}
    held = pending_request.kwargs.get(PREFIX_BLOCKS_KWARG) or {}
    return {k: v for k, v in held.items() if isinstance(k, str) and isinstance(v, int)}


def request_block_hashes(pending_request: PendingRequest | None) -> list[bytes]:
    """The chain the request carries (`GenerateRequest.block_hashes`, its first argument)."""
    if pending_request is None or not pending_request.args:
        return []
    hashes = getattr(pending_request.args[0], "block_hashes", ()) or ()
    return [h for h in hashes if isinstance(h, bytes)]
