"""Prefix routing through the KV directory against Serve's default router, side by side.

`benchmarks.serving --routing-replicas N` runs it on its local cluster: two more applications
as shipped (ingress + N engine replicas), one whose engine deployment uses `PrefixAwareRouter`
(fed by the KV directory) and one Serve's default power-of-two-choices router, get the same
seeded workload over the default HTTP path: `--routing-prefixes` distinct prefixes of
`ROUTING_PREFIX_TOKENS` tokens, each followed by a unique `ROUTING_TAIL_TOKENS`-token tail,
`ROUTING_REPEATS` requests per prefix in shuffled order, `--routing-concurrency` in flight.

Per router it reports the fraction of prompt tokens served from cache (the engines' own count,
from each response's usage), that fraction over the best possible for the workload (every
prefix computed exactly once), how many replicas each prefix was spread over, and TTFT p50; for
the directory, its round trip from the ingress (p50) as /metrics reports it.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from benchmarks.load import Job, one_request

ROUTING_PREFIX_TOKENS = 512
ROUTING_TAIL_TOKENS = 64
ROUTING_REPEATS = 3


def routing_workload(
    rng: random.Random, prefixes: int, repeats: int = ROUTING_REPEATS
) -> list[tuple[int, list[int]]]:
    """(prefix index, token ids) in shuffled order; ids stay below 250 (any vocabulary)."""
    heads = [[rng.randrange(3, 250) for _ in range(ROUTING_PREFIX_TOKENS)] for _ in range(prefixes)]
    order = [i for i in range(prefixes) for _ in range(repeats)]
    rng.shuffle(order)
    return [
        (i, heads[i] + [rng.randrange(3, 250) for _ in range(ROUTING_TAIL_TOKENS)]) for i in order
    ]


def best_cached_fraction(prompts: list[tuple[int, list[int]]], block_size: int) -> float:
    """Every prefix computed once and hit by each repeat (whole blocks only)."""
    seen: set[int] = set()
    cached = 0
    for prefix, _ in prompts:
        if prefix in seen:
            cached += ROUTING_PREFIX_TOKENS - ROUTING_PREFIX_TOKENS % block_size
        seen.add(prefix)
    return cached / sum(len(ids) for _, ids in prompts)


async def drive(
    base: str, model: str, key: str, prompts: list[tuple[int, list[int]]], concurrency: int
) -> dict[str, Any]:
    queue: asyncio.Queue[tuple[int, list[int]]] = asyncio.Queue()
    for item in prompts:
        queue.put_nowait(item)
    ttfts: list[float] = []
    cached = total = failures = 0
    errors: list[str] = []
    spread: dict[int, set[str]] = {}
    bar = tqdm(total=len(prompts), desc="routing", file=sys.stderr, leave=False)
    headers = {"Authorization": f"Bearer {key}"}

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal cached, total, failures
        while not queue.empty():
            prefix, ids = queue.get_nowait()
            result = await one_request(client, model, Job(ids, 2))
            bar.update()
            if not result.prompt_tokens:  # no usage came back: the request failed
                failures += 1
                errors.append(result.error or "no usage in the stream")
                continue
            if result.ok:  # some random prompts' 2 tokens decode to no text: no TTFT then
                ttfts.append(result.ttft)
            cached += result.cached_tokens
            total += result.prompt_tokens
            spread.setdefault(prefix, set()).add(result.served_by)

    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        metrics = (await client.get("/metrics")).text
    bar.close()
    return {
        "cached_fraction": cached / max(1, total),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "mean_replicas_per_prefix": statistics.mean(len(s) for s in spread.values()),
        "failures": failures,
        "errors": errors[:3],
        "directory_round_trip_us_p50": directory_round_trip_us(metrics),
    }


def directory_round_trip_us(metrics_text: str) -> float | None:
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "pagedserve_kv_directory_query_seconds"
                and labels.get("where") == "round_trip"
                and labels.get("quantile") == "0.5"
            ):
                return round(sample.value * 1e6, 1)
    return None


def routing_comparison(
    app_args: dict[str, Any],
    http_base: str,
    key: str,
    *,
    replicas: int,
    prefixes: int,
    concurrency: int,
    seed: int,
) -> dict[str, Any]:
    """Both routers on the same prompts (Ray and Serve running, HTTP on `http_base`)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from cluster.engine.config import EngineConfig
    from cluster.serving.routing import ROUTER_CLASS_PATH
    from cluster.serving.serve_app import bind_app

    prompts = routing_workload(random.Random(seed), prefixes)
    block_size = EngineConfig.build(app_args["engine"]).cache.block_size
    results: dict[str, Any] = {}
    routers = {
        "prefix_aware": ROUTER_CLASS_PATH,
        "power_of_two": RequestRouterConfig().request_router_class,  # Serve's default
    }
    for label, router in routers.items():
        engine_options = {
            "num_replicas": replicas,
            "request_router_config": RequestRouterConfig(request_router_class=router),
            "ray_actor_options": {"num_cpus": 0},
            "max_ongoing_requests": 16,
        }
        no_cpu = {"ray_actor_options": {"num_cpus": 0}}
        app = bind_app(app_args, engine_options=engine_options, ingress_options=no_cpu)
        route = f"/routing-{label}"
        serve.run(app, name=f"routing-{label}", route_prefix=route)
        model = app_args["served_model_name"]
        results[label] = asyncio.run(drive(http_base + route, model, key, prompts, concurrency))
        serve.delete(f"routing-{label}")
    best = best_cached_fraction(prompts, block_size)
    for label in routers:
        results[label]["of_best_possible"] = results[label]["cached_fraction"] / best
    results["best_possible_cached_fraction"] = best
    results["config"] = {
        "replicas": replicas,
        "prefixes": prefixes,
        "repeats": ROUTING_REPEATS,
        "prefix_tokens": ROUTING_PREFIX_TOKENS,
        "tail_tokens": ROUTING_TAIL_TOKENS,
        "concurrency": concurrency,
    }
    return results
