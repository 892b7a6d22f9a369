"""Prefix-aware routing on a real local Ray cluster: two replicas of the Serve deployment behind
`PrefixAwareRouter`. A prompt that repeats a prefix goes to the replica that computed it, and that
replica's engine reports the prefix as cached (`num_cached_tokens`, the engine's own count)."""

from __future__ import annotations

import asyncio
import pathlib
import random
import time
from collections.abc import Iterator

import pytest

from cluster.engine.sampling_params import SamplingParams
from tests.serving.conftest import MODEL, Served, engine_section, run_two_engine_app
from tests.serving.routed_calls import RoutedClient, RoutedOutput

PREFIX_TOKENS = 24  # 6 blocks of 4
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def routed_app(served: Served, tiny_model_dir: pathlib.Path) -> Iterator[object]:
    """A second application on the session's Serve instance, with two replicas."""
    from ray import serve

    args = {"served_model_name": MODEL, "engine": engine_section(tiny_model_dir)}
    handle = run_two_engine_app("routed", "/routed", args)
    yield handle
    serve.delete("routed")


async def run_one(client: RoutedClient, ids: list[int]) -> RoutedOutput:
    result = await client.generate({"prompt_token_ids": ids}, GREEDY)
    assert result.output.finished
    return result


def test_a_repeated_prefix_goes_to_the_replica_that_holds_it(routed_app: object) -> None:
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 250) for _ in range(PREFIX_TOKENS)] for _ in range(3)]

    async def scenario() -> list[tuple[int, RoutedOutput]]:
        client = await RoutedClient.connect("routed")
        results = []
        for _ in range(4):
            for which, prefix in enumerate(prefixes):
                tail = [rng.randrange(3, 250) for _ in range(3)]
                results.append((which, await run_one(client, prefix + tail)))
        return results

    results = asyncio.run(scenario())
    directory_check(results, prefixes)
    replicas_by_prefix: dict[int, set[str]] = {}
    for which, result in results:
        replicas_by_prefix.setdefault(which, set()).add(result.replica_id)
    assert all(len(replicas) == 1 for replicas in replicas_by_prefix.values()), replicas_by_prefix
    repeats = results[len(prefixes) :]
    assert all(r.output.num_cached_tokens >= PREFIX_TOKENS for _, r in repeats)
    first_round = results[: len(prefixes)]
    assert all(r.output.num_cached_tokens == 0 for _, r in first_round)


def directory_check(results: list[tuple[int, RoutedOutput]], prefixes: list[list[int]]) -> None:
    """The KV directory holds each served prefix, whole, for the replica that served it: the
    hashes the engine replicas report are the chain the ingress computes for the prompt."""
    import ray
    from ray import serve

    from block_manager import prompt_block_hashes
    from cluster.serving.kv_directory import DIRECTORY_NAMESPACE, directory_name
    from cluster.serving.serve_app import DEPLOYMENT_NAME

    engine = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name="routed")
    directory = ray.get_actor(directory_name("routed"), namespace=DIRECTORY_NAMESPACE)
    description = engine.describe.remote().result()
    key = description.keys.factory.key()  # a token-id prompt of the keyless tenant
    served_by = {which: result.replica_id for which, result in results}
    for which, prefix in enumerate(prefixes):
        chain = prompt_block_hashes([*prefix, 0], key, description.block_size)
        assert len(chain) == PREFIX_TOKENS // 4
        deadline = time.monotonic() + 10  # the replica's next event batch may be in flight
        while True:
            holdings = ray.get(directory.query.remote(chain))
            held = holdings.get(served_by[which])
            if (held is not None and held.blocks == len(chain)) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert held is not None and held.blocks == len(chain), holdings


def test_a_prompt_without_hashes_is_still_served(routed_app: object) -> None:
    async def scenario() -> RoutedOutput:
        return await (await RoutedClient.connect("routed")).generate("Hello there", GREEDY)

    result = asyncio.run(scenario())
    assert result.output.finished and len(result.output.outputs[0].token_ids) == 2
