"""Routing of a disaggregated application's decode calls: by KV pressure.

A resumed request arrives with its prompt's KV on a prefill replica, so which decode replica
holds a prefix matters little; what a decode replica runs out of is KV blocks (each running
sequence keeps growing). `KVPressureRouter` ranks the decode replicas by the fraction of their
device blocks in use (`LoadReport.kv_utilization`, from Serve's routing stats), then by how
busy they are, and keeps overloaded ones (`ReplicaView.overloaded`) last. A call naming one
replica (a KV pull, `TARGET_REPLICA_KWARG`) goes there, as on the prefill side.

Invariant: as with `PrefixAwareRouter`, the choice only ranks replicas: Serve still probes
queue lengths and moves on to the next rank when a replica is full.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.serving.routing import (
    TARGET_REPLICA_KWARG,
    LoadReport,
    ReplicaView,
    RoutingPolicy,
)

DECODE_ROUTER_CLASS_PATH = "cluster.serving.pd_routing:KVPressureRouter"
KV_BUCKET = 0.05
"""KV utilisations this close count as equal (then the less busy replica goes first)."""


def rank_by_pressure(
    views: list[ReplicaView], policy: RoutingPolicy, rng: random.Random
) -> list[list[Any]]:
    """The two replicas with the least KV pressure first (Serve takes the shorter queue of
    the two), the rest after; overloaded replicas last."""
    order = sorted(
        views,
        key=lambda v: (
            v.overloaded(policy),
            int(v.load.kv_utilization / KV_BUCKET),
            v.busyness(),
            rng.random(),
        ),
    )
    first, rest = order[:2], order[2:]
    ranks = [[v.replica for v in first]]
    if rest:
        ranks.append([v.replica for v in rest])
    return ranks if first else []


class KVPressureRouter(RequestRouter):
    """Serve request router of the decode deployment (see the module doc)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = RoutingPolicy(**kwargs)
        self._rng = random.Random()

    def _view(self, candidate: RunningReplica) -> ReplicaView:
        ongoing = self.replica_queue_len_cache.get(candidate.replica_id) or 0
        load = (candidate.routing_stats or {}).get("load", LoadReport())
        return ReplicaView(candidate, ongoing, candidate.max_ongoing_requests, load)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get(TARGET_REPLICA_KWARG) if pending_request else None
        if target is not None:
            named = [c for c in candidate_replicas if c.replica_id.unique_id == target]
            if named:
                return [named]
        views = [self._view(c) for c in candidate_replicas]
        return rank_by_pressure(views, self.policy, self._rng)
