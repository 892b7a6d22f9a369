"""The KV directory under faults, on a real local Ray cluster (the two engine replicas of the
session's two-replica application, tests/serving/two_replicas.py): when the directory dies no
request fails and routing falls back to load; Ray restarts it and it rebuilds from the
replicas' snapshots; when an engine replica dies, its entries are dropped."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from block_manager import prompt_block_hashes
from cluster.engine.sampling_params import SamplingParams
from tests.serving import two_replicas
from tests.serving.routed_calls import RoutedClient, RoutedOutput
from tests.serving.two_replicas import TwoReplicaApp

APP = two_replicas.APP
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
PREFIX_TOKENS = 24  # 6 blocks of 4


def holdings(chain: list[bytes]) -> dict[str, Any]:
    """The directory's answer, or {} while Ray is still restarting it."""
    import ray

    try:
        return dict(ray.get(two_replicas.directory().query.remote(chain), timeout=5))
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
        return {}
    except ray.exceptions.GetTimeoutError:
        return {}


def chain_of(ids: list[int]) -> list[bytes]:
    from ray import serve

    from cluster.serving.serve_app import DEPLOYMENT_NAME

    engine = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP)
    description = engine.describe.remote().result()
    return prompt_block_hashes(ids, description.keys.factory.key(), description.block_size)


def serve_all(prompts: list[list[int]]) -> list[RoutedOutput]:
    async def run() -> list[RoutedOutput]:
        client = await RoutedClient.connect(APP)
        results = []
        for ids in prompts:
            result = await client.generate({"prompt_token_ids": ids}, GREEDY)
            assert result.output.finished
            results.append(result)
        return results

    return asyncio.run(run())


def wait_for(condition: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_a_dead_directory_fails_no_request_and_is_rebuilt(two_replica_app: TwoReplicaApp) -> None:
    import ray

    rng = random.Random(11)
    prefix = [rng.randrange(3, 250) for _ in range(PREFIX_TOKENS)]
    (first,) = serve_all([[*prefix, 5]])
    chain = chain_of([*prefix, 0])
    held = wait_for(lambda: holdings(chain).get(first.replica_id), 10)
    assert held is not None and held.blocks == len(chain)

    ray.kill(two_replicas.directory(), no_restart=False)  # Ray restarts it, empty
    started = time.monotonic()
    others = [[rng.randrange(3, 250) for _ in range(8)] for _ in range(6)]
    results = serve_all(others)  # while it is down or rebuilding: none may fail
    assert len(results) == len(others)
    assert all(len(r.output.outputs[0].token_ids) == 2 for r in results)

    rebuilt = wait_for(lambda: holdings(chain).get(first.replica_id), 15)
    assert rebuilt is not None and rebuilt.blocks == len(chain), "not rebuilt from snapshots"
    assert time.monotonic() - started < 20

    def both_resent() -> bool:
        return ray.get(two_replicas.directory().report.remote()).stats.snapshots >= 2

    assert wait_for(both_resent, 10), "not every replica resent its snapshot"


@pytest.mark.kills_a_replica
def test_a_dead_replica_loses_its_entries(two_replica_app: TwoReplicaApp) -> None:
    import ray

    rng = random.Random(12)
    prefix = [rng.randrange(3, 250) for _ in range(PREFIX_TOKENS)]
    (served_by,) = serve_all([[*prefix, 7]])
    victim = served_by.replica_id
    chain = chain_of([*prefix, 0])
    assert wait_for(lambda: victim in holdings(chain), 10)

    replica = ray.get_actor(two_replicas.replica_actor_name(victim), namespace="serve")
    ray.kill(replica, no_restart=True)

    def gone() -> bool:
        report = ray.get(two_replicas.directory().report.remote())
        return victim not in report.stats.entries_by_replica

    assert wait_for(gone, 15), "the dead replica's entries are still indexed"
    assert victim not in holdings(chain)
    # The application keeps serving on the other replica (and Serve's replacement).
    results = serve_all([[*prefix, 9]])
    assert results[0].replica_id != victim
