"""Tensor-parallel ranks go into their replica's own placement group.

A simulated two-node cluster (`ray.cluster_utils.Cluster`, each node declaring 2 fake GPUs)
hosts two "replicas" shaped as the Helm chart makes them: a STRICT_PACK group of the replica's
CPU bundle then one GPU bundle per rank. Each replica builds a TP=2 `WorkerGroup` of the tiny
model (device forced to CPU) in a worker thread, as `GenerationServer` does. Checked: each
replica's ranks sit in bundles 1 and 2 of its own group, on its node; the four ranks use the
cluster's four GPUs and no more (a second group per replica would need eight and never fit).
"""

from __future__ import annotations

import asyncio
import pathlib
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.engine.config import EngineConfig
from tests.engine.tiny_engine import tiny_config

# No Serve: beside the Serve tests under xdist, its own cluster before the shared one there.
pytestmark = [pytest.mark.ray, pytest.mark.own_ray, pytest.mark.plain_ray]

TP = 2
NODES = 2
GPUS_PER_NODE = 2
REPLICA_TIMEOUT_S = 90


class Replica:
    """Stands for a Serve replica: builds its worker group off its event loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.workers: Any = None

    async def start(self) -> dict[str, Any]:
        from workers import WorkerGroup

        self.workers = await asyncio.to_thread(WorkerGroup, self.config.to_worker_config())
        placement = self.workers.placement
        context = ray.get_runtime_context()
        return {
            "node": context.get_node_id(),
            "group": context.get_placement_group_id(),
            "rank_group": placement.placement_group.id.hex(),
            "owned": placement.owned,
            "bundles": placement.bundle_indices,
            "rank_nodes": await asyncio.to_thread(self.workers.rank_nodes),
            "blocks": self.workers.num_device_blocks,
        }

    def stop(self) -> None:
        self.workers.shutdown()


@pytest.fixture
def fake_gpu_cluster() -> Any:
    cluster = Cluster()
    for _ in range(NODES):
        cluster.add_node(num_cpus=4, num_gpus=GPUS_PER_NODE)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_each_replicas_ranks_land_in_its_own_bundles(
    tiny_model_dir: pathlib.Path, fake_gpu_cluster: Any
) -> None:
    config = tiny_config(
        tiny_model_dir, parallel={"backend": "ray", "tensor_parallel_size": TP, "device": "cpu"}
    )
    bundles = [{"CPU": 1.0}] + [{"CPU": 1.0, "GPU": 1.0} for _ in range(TP)]
    groups, replicas = [], []
    for _ in range(NODES):
        group = placement_group(bundles, strategy="STRICT_PACK")
        ray.get(group.ready(), timeout=30)
        groups.append(group)
        strategy = PlacementGroupSchedulingStrategy(group, 0)
        actor = ray.remote(Replica).options(num_cpus=1, scheduling_strategy=strategy)
        replicas.append(actor.remote(config))
    try:
        reports = ray.get([r.start.remote() for r in replicas], timeout=REPLICA_TIMEOUT_S)
        assert ray.available_resources().get("GPU", 0) == 0  # all four in use, by the ranks
        for report, group in zip(reports, groups, strict=True):
            assert report["group"] == group.id.hex() == report["rank_group"]
            assert report["owned"] is False and report["bundles"] == [1, 2]
            assert report["rank_nodes"] == [report["node"]] * TP
            assert report["blocks"] > 0
        assert len({r["node"] for r in reports}) == NODES  # STRICT_PACK: one replica a node
        assert ray.cluster_resources()["GPU"] == NODES * GPUS_PER_NODE
        ray.get([r.stop.remote() for r in replicas], timeout=60)
    finally:
        for replica in replicas:
            ray.kill(replica)
        for group in groups:
            remove_placement_group(group)


def test_a_group_too_small_for_the_ranks_is_refused_with_the_fix() -> None:
    from workers.placement import _in_replica_group

    group = SimpleNamespace(bundle_specs=[{"CPU": 1.0, "GPU": 1.0}] * 2)
    with pytest.raises(ValueError, match="the replica's own bundle first, then one per rank"):
        _in_replica_group(group, 2, "auto")
