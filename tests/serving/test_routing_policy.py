"""The router's ranking and the autoscaling policy as pure functions: longest held prefix
first unless overloaded; KV pressure raises the replica estimate above the queue estimate."""

from __future__ import annotations

import random

import pytest
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from block_manager import CacheIdentity, CacheKey, KVCacheManager
from cluster.serving.autoscaling import (
    KV_UTILIZATION,
    KVPressurePolicy,
    desired_replicas,
    kv_used_fraction,
)
from cluster.serving.routing import LoadReport, ReplicaView, RoutingPolicy, rank_replicas
from cluster.serving.serve_app import build_app

POLICY = RoutingPolicy(overload_fraction=0.5, max_waiting=2, max_kv_utilization=0.9)


def view(name: str, ongoing: int = 0, waiting: int = 0, kv: float = 0.0) -> ReplicaView:
    return ReplicaView(
        name, ongoing, 8, LoadReport(num_running=0, num_waiting=waiting, kv_utilization=kv)
    )


def first_rank(views: list[ReplicaView], prefix: dict[str, int]) -> list[str]:
    ranks = rank_replicas(views, prefix, POLICY, random.Random(0))
    assert sorted(r for rank in ranks for r in rank) == sorted(v.replica for v in views)
    return ranks[0]


def first_choice(views: list[ReplicaView], prefix: dict[str, int]) -> str:
    (choice,) = first_rank(views, prefix)
    return choice


def test_the_longest_held_prefix_wins_over_a_less_busy_replica() -> None:
    views = [view("a", ongoing=3), view("b", ongoing=0), view("c", ongoing=1)]
    assert first_choice(views, {"a": 5, "c": 2}) == "a"
    assert first_choice(views, {"a": 2, "c": 2}) == "c"  # a tie goes to the less busy


@pytest.mark.parametrize(
    "overloaded", [view("a", ongoing=4), view("a", waiting=2), view("a", kv=0.95)]
)
def test_an_overloaded_holder_is_passed_over(overloaded: ReplicaView) -> None:
    views = [overloaded, view("b", ongoing=2), view("c", ongoing=1)]
    assert first_choice(views, {"a": 9, "b": 1}) == "b"  # the next holder
    assert first_rank(views, {"a": 9}) == ["c", "b"]  # no other holder: the two least busy


def test_without_a_prefix_the_two_least_busy_go_first() -> None:
    views = [view("a", ongoing=3), view("b", waiting=1), view("c", ongoing=1, waiting=1)]
    assert first_rank(views, {}) == ["b", "c"]
    assert first_rank(views[:1], {}) == ["a"]
    assert rank_replicas([], {}, POLICY, random.Random(0)) == []


def test_routing_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="overload_fraction"):
        RoutingPolicy(overload_fraction=0)
    with pytest.raises(ValueError, match="max_kv_utilization"):
        RoutingPolicy(max_kv_utilization=1.5)


def test_desired_replicas_is_the_larger_of_queue_and_kv_estimates() -> None:
    def desired(ongoing: float, kv: dict[str, float]) -> float:
        return desired_replicas(
            current_replicas=2,
            ongoing_requests=ongoing,
            target_ongoing_requests=4,
            kv_utilization=kv,
            target_kv_utilization=0.5,
        )

    assert desired(12, {}) == 3  # queue only: 12 / 4
    assert desired(4, {"r1": 0.9, "r2": 0.7}) == pytest.approx(3.2)  # 2 * 0.8 / 0.5
    assert desired(12, {"r1": 0.1, "r2": 0.1}) == 3  # queue dominates
    assert (
        desired_replicas(
            current_replicas=0,
            ongoing_requests=3,
            target_ongoing_requests=4,
            kv_utilization={},
            target_kv_utilization=0.5,
        )
        == 1
    )


def test_kv_pressure_policy_reads_serves_context() -> None:
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=2)
    ctx = AutoscalingContext(
        deployment_id=None,  # type: ignore[arg-type]
        deployment_name="GenerationServer",
        app_name="pagedserve",
        current_num_replicas=2,
        target_num_replicas=2,
        running_replicas=[],
        total_num_requests=2.0,
        total_queued_requests=0.0,
        aggregated_metrics={KV_UTILIZATION: {"r1": 0.9, "r2": 0.9}},
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=config,
    )
    desired, state = KVPressurePolicy(target_kv_utilization=0.6)(ctx)
    assert desired == pytest.approx(3.0) and state == {}
    with pytest.raises(ValueError, match="target_kv_utilization"):
        KVPressurePolicy(target_kv_utilization=0)


def test_shared_prefixes_are_accepted_and_empty_ones_refused() -> None:
    build_app({"shared_prefixes": ["You are a helpful assistant."]})
    with pytest.raises(ValueError, match="shared_prefixes"):
        build_app({"shared_prefixes": [""]})


def test_kv_used_fraction_counts_referenced_blocks_only() -> None:
    seed = CacheIdentity(model_weights_digest="w", tokenizer_digest="t", block_size=4).digest()
    manager = KVCacheManager(num_device_blocks=16, num_cpu_blocks=0, block_size=4)
    assert kv_used_fraction(manager.pressure()) == 0.0
    manager.allocate(0, list(range(10)), CacheKey(seed))  # 3 blocks
    assert kv_used_fraction(manager.pressure()) == 3 / 16
    manager.mark_computed(0, 10)
    manager.free(0)  # two sealed blocks stay cached but unreferenced
    assert kv_used_fraction(manager.pressure()) == 0.0
