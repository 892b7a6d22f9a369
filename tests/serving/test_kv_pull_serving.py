"""Peer pull between the two engine replicas of the session's two-replica Serve application
(tests/serving/two_replicas.py; tiny Llama, float32, pulls without the cost model): a
prefix computed on one replica is pulled by the other through the directory and the Ray
transport, with the oracle's greedy tokens; a dead holder fails no request."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any

import pytest

from cluster.engine.generate_request import GenerateRequest
from cluster.engine.output_stream import OutputAccumulator
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenization import RenderedPrompt
from cluster.kv_transfer.hint import KVSourceHint
from tests.serving import two_replicas
from tests.serving.conftest import GreedyOracle
from tests.serving.two_replicas import TwoReplicaApp

APP = two_replicas.APP
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PREFIX_TOKENS = 40  # 10 blocks of 4


def _engine() -> Any:
    from ray import serve

    from cluster.serving.serve_app import DEPLOYMENT_NAME

    return serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP)


def _request(ids: list[int], keys: Any, **fields: Any) -> GenerateRequest:
    request = GenerateRequest(RenderedPrompt(ids, None), GREEDY, **fields)
    return dataclasses.replace(request, block_hashes=tuple(keys.block_hashes(request)))


async def _generate(request: GenerateRequest, **kwargs: Any) -> tuple[str, RequestOutput]:
    stream = _engine().options(stream=True).generate.remote(request, **kwargs)
    accumulator, output, served_by = OutputAccumulator(), None, ""
    async for delta in stream:
        output = accumulator.apply(delta)
        served_by = delta.served_by
    assert output is not None and output.finished
    return served_by, output


def _replicas() -> list[str]:
    import ray

    directory = two_replicas.directory()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        replicas = list(ray.get(directory.report.remote()).stats.entries_by_replica)
        if len(replicas) == 2:
            return replicas
        time.sleep(0.2)
    raise AssertionError("both replicas never reached the directory")


async def _wait_held(holder: str, chain: list[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        held = await two_replicas.directory().query.remote(chain)
        if holder in held and held[holder].blocks == len(chain):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the directory never heard of the holder's blocks")


@pytest.mark.kills_a_replica
def test_a_peer_pulls_the_prefix_and_a_dead_holder_fails_nothing(
    two_replica_app: TwoReplicaApp, oracle: GreedyOracle
) -> None:
    import ray

    rng = random.Random(5)
    prefix = [rng.randrange(3, 250) for _ in range(PREFIX_TOKENS)]
    first_ids, second_ids, third_ids = ([*prefix, tail] for tail in (5, 6, 7))
    replicas = _replicas()

    async def scenario() -> tuple[str, str, RequestOutput, RequestOutput, RequestOutput]:
        keys = (await _engine().describe.remote()).keys
        first_request = _request(first_ids, keys)
        holder, first = await _generate(first_request, target_replica=replicas[0])
        other = next(r for r in replicas if r != holder)
        await _wait_held(holder, list(first_request.block_hashes))
        served, pulled = await _generate(_request(second_ids, keys), target_replica=other)
        assert served == other
        # the holder dies; a request hinted to pull from it is computed, and succeeds
        replica = ray.get_actor(two_replicas.replica_actor_name(holder), namespace="serve")
        ray.kill(replica, no_restart=True)
        hint = KVSourceHint(holder, first_request.block_hashes)
        fresh = [rng.randrange(3, 250) for _ in range(PREFIX_TOKENS)]
        third_ids[:] = [*fresh, 7]
        _, third = await _generate(
            dataclasses.replace(_request(third_ids, keys), kv_source=hint), target_replica=other
        )
        return holder, other, first, pulled, third

    holder, other, first, pulled, third = asyncio.run(scenario())
    assert holder != other
    assert first.num_cached_tokens == 0
    assert pulled.num_cached_tokens == PREFIX_TOKENS  # every full prefix block came by pull
    for ids, output in ((first_ids, first), (second_ids, pulled), (third_ids, third)):
        expected, _ = oracle.generate(ids, GREEDY.max_tokens)
        assert output.outputs[0].token_ids == expected
