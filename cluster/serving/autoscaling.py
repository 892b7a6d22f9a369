"""Replica autoscaling on queue depth and KV-cache pressure: a Ray Serve custom autoscaling
policy (`autoscaling_config.policy.policy_function: cluster.serving.autoscaling:KVPressurePolicy`).

Serve's default policy scales on ongoing requests per replica alone. An LLM replica can be short
of KV blocks (long prompts, long generations: requests waiting or preempted) well before it has
many requests, so each replica also reports its KV utilization and waiting queue
(`record_autoscaling_stats`, see `autoscaling_stats`), and the desired replica count is the larger
of the two estimates. Serve applies `min_replicas`/`max_replicas`, the up/down-scaling factors and
`upscale_delay_s`/`downscale_delay_s` around it.

Invariants: the policy is a pure function of the context it is given (no clock, no I/O); with no
custom metrics yet it is exactly the queue-depth estimate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve.config import AutoscalingContext

from block_manager import PressureSnapshot
from cluster.engine.metrics import EngineMetrics

POLICY_PATH = "cluster.serving.autoscaling:KVPressurePolicy"
KV_UTILIZATION = "kv_used_fraction"
WAITING = "num_waiting"


def kv_used_fraction(pressure: PressureSnapshot) -> float:
    """Referenced device blocks over all device blocks: how full the KV cache is (evictable
    cached blocks count as free: an allocation may reuse them)."""
    return pressure.device.used / pressure.device.total if pressure.device.total else 1.0


def autoscaling_stats(metrics: EngineMetrics) -> dict[str, float]:
    """What a replica's `record_autoscaling_stats` returns (numbers only, as Serve requires)."""
    return {
        KV_UTILIZATION: kv_used_fraction(metrics.pressure),
        WAITING: float(metrics.num_waiting),
    }


def desired_replicas(
    *,
    current_replicas: int,
    ongoing_requests: float,
    target_ongoing_requests: float,
    kv_utilization: Mapping[Any, float],
    target_kv_utilization: float,
) -> float:
    """max(ongoing / target per replica, replicas * mean KV utilization / target utilization)."""
    if current_replicas == 0:
        return 1.0 if ongoing_requests > 0 else 0.0
    by_queue = ongoing_requests / target_ongoing_requests
    if not kv_utilization:
        return by_queue
    mean_kv = sum(kv_utilization.values()) / len(kv_utilization)
    return max(by_queue, current_replicas * mean_kv / target_kv_utilization)


class KVPressurePolicy:
    """Serve custom autoscaling policy (a class, so `policy_kwargs` reach it)."""

    def __init__(self, target_kv_utilization: float = 0.8) -> None:
        if not 0.0 < target_kv_utilization <= 1.0:
            raise ValueError(
                f"target_kv_utilization must be in (0, 1], got {target_kv_utilization}"
            )
        self.target_kv_utilization = target_kv_utilization

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        desired = desired_replicas(
            current_replicas=ctx.current_num_replicas,
            ongoing_requests=ctx.total_num_requests,
            target_ongoing_requests=ctx.config.get_target_ongoing_requests(),
            kv_utilization=metrics.get(KV_UTILIZATION, {}),
            target_kv_utilization=self.target_kv_utilization,
        )
        return desired, {}
