"""Routing between two engine replicas on a real local Ray cluster: one application whose
ingress (with API keys) calls two replicas of the Serve deployment behind `PrefixAwareRouter`.

- Through the ingress over HTTP: repeated-prefix requests land on one replica (the
  `x-pagedserve-replica` header names the replica that served it) whose engine reports the
  prefix as cached, and streaming, errors, disconnects and the `openai` client work through it
  unchanged.
- Through the engine deployment's handle: a prompt that repeats a prefix goes to the replica
  that computed it, that replica's engine reports the prefix as cached (`num_cached_tokens`, the
  engine's own count), and the KV directory holds the prefix for it.

The session's two-replica application serves both (`tests/serving/two_replicas.py`: deploying
two engine replicas is the slow part)."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.engine.sampling_params import SamplingParams
from cluster.serving.http_api import REPLICA_HEADER
from tests.serving import two_replicas
from tests.serving.conftest import MODEL
from tests.serving.routed_calls import RoutedClient, RoutedOutput
from tests.serving.two_replicas import TwoReplicaApp

APP = two_replicas.APP
PREFIX_TOKENS = 24  # 6 blocks of 4
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
ALICE = {"Authorization": "Bearer key-alice"}
WORDS = [
    "paged",
    "block",
    "cache",
    "tenant",
    "replica",
    "router",
    "prefix",
    "token",
    "stream",
    "engine",
]


@pytest.fixture
def ingress_base(two_replica_app: TwoReplicaApp) -> str:
    """The HTTP base URL of the session's two-replica application (handles reach it by name,
    APP)."""
    return two_replica_app.base


def complete(base: str, prompt: str, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, headers=ALICE, timeout=60)


def test_repeated_prefix_http_requests_land_on_one_replica(ingress_base: str) -> None:
    rng = random.Random(3)
    prefixes = [f"Prefix {i}: " + " ".join(rng.choice(WORDS) for _ in range(24)) for i in range(3)]
    replicas: dict[int, set[str]] = {}
    cached: dict[int, list[int]] = {}
    for _ in range(4):
        for which, prefix in enumerate(prefixes):
            response = complete(ingress_base, prefix + f" and then {rng.choice(WORDS)}?")
            assert response.status_code == 200, response.text
            replicas.setdefault(which, set()).add(response.headers[REPLICA_HEADER])
            usage = response.json()["usage"]
            cached.setdefault(which, []).append(usage["prompt_tokens_details"]["cached_tokens"])
    assert all(len(r) == 1 for r in replicas.values()), replicas
    for counts in cached.values():
        assert counts[0] == 0 and all(c >= 16 for c in counts[1:]), cached


def test_streaming_errors_and_the_openai_client_through_the_ingress(ingress_base: str) -> None:
    client = openai.OpenAI(base_url=f"{ingress_base}/v1", api_key="key-bob", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say something about paging."}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{ingress_base}/v1", api_key="nope", max_retries=0).models.list()
    bad = complete(ingress_base, "hello", max_tokens=-1)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    missing = httpx.get(f"{ingress_base}/v1/nothing", headers=ALICE, timeout=30)
    assert missing.status_code == 404 and "error" in missing.json()
    assert httpx.get(f"{ingress_base}/health", timeout=30).json() == {"status": "ok"}


def metrics_by_replica(base: str, wanted: set[str] | None = None) -> dict[str, dict[str, float]]:
    """Prometheus samples (without the replica label) of the `wanted` replicas (by default the
    two of the app): /metrics through the ingress reaches the less busy replica, so ask until
    each wanted one answered."""
    answered: dict[str, dict[str, float]] = {}
    for _ in range(200):
        response = httpx.get(f"{base}/metrics", timeout=30)
        replica = response.headers[REPLICA_HEADER]
        samples = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "replica"
                )
                samples[f"{sample.name}{{{labels}}}"] = sample.value
        answered[replica] = samples
        if (wanted is None and len(answered) == 2) or (wanted and wanted <= set(answered)):
            return answered
        time.sleep(0.05)
    raise AssertionError(f"not every replica answered /metrics: {sorted(answered)}")


def replica_metrics(base: str, replica: str) -> dict[str, float]:
    return metrics_by_replica(base, {replica})[replica]


def test_a_disconnect_through_the_ingress_aborts_and_frees_blocks(ingress_base: str) -> None:
    body = {"model": MODEL, "prompt": "Tell", "max_tokens": 400, "stream": True, "ignore_eos": True}
    running = "pagedserve_sequences{queue=running}"
    used = "pagedserve_kv_cache_blocks{state=used,tier=device}"
    generated = "pagedserve_generated_tokens_total{}"
    before = metrics_by_replica(ingress_base)
    with httpx.stream(
        "POST", f"{ingress_base}/v1/completions", json=body, headers=ALICE, timeout=60
    ) as response:
        replica = response.headers[REPLICA_HEADER]
        lines = response.iter_lines()  # kept alive: closing it would close the connection
        events = 0
        while events < 3:
            events += next(lines).startswith("data: ")
    # The replica answers /metrics again once it is idle, which it is only after the abort.
    deadline = time.monotonic() + 20
    after = replica_metrics(ingress_base, replica)
    while (after[running] or after[used]) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = replica_metrics(ingress_base, replica)
    assert after[running] == 0 and after[used] == 0
    assert after[generated] - before[replica][generated] < 300  # aborted, short of its 400


async def run_one(client: RoutedClient, ids: list[int]) -> RoutedOutput:
    result = await client.generate({"prompt_token_ids": ids}, GREEDY)
    assert result.output.finished
    return result


def test_a_repeated_prefix_goes_to_the_replica_that_holds_it(ingress_base: str) -> None:
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 250) for _ in range(PREFIX_TOKENS)] for _ in range(3)]

    async def scenario() -> list[tuple[int, RoutedOutput]]:
        client = await RoutedClient.connect(APP)
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

    engine = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP)
    directory = ray.get_actor(directory_name(APP), namespace=DIRECTORY_NAMESPACE)
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


def test_a_prompt_without_hashes_is_still_served(ingress_base: str) -> None:
    async def scenario() -> RoutedOutput:
        return await (await RoutedClient.connect(APP)).generate("Hello there", GREEDY)

    result = asyncio.run(scenario())
    assert result.output.finished and len(result.output.outputs[0].token_ids) == 2
