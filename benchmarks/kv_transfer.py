"""KV peer pull, measured: a load that spreads repeats of long prefixes over two engine replicas
(pull on against pull off, over the default HTTP path), and the bandwidth of the block path.

``python -m benchmarks.kv_transfer --json`` starts a local Ray cluster and deploys the shipped
application (``cluster/serving/serve_config.yaml``, the default model) twice in turn, with two
engine replicas each: ``kv_transfer.pull`` on, then off. Both get the same seeded prompts:
``--prefixes`` distinct prefixes of ``--prefix-tokens`` tokens, ``--repeats`` requests each
(unique 32-token tails, 2 output tokens): the first of every prefix, then each prefix's other
repeats back to back, ``--concurrency`` in flight; the router counts a replica overloaded from
``--overload-fraction`` of its 16 ongoing requests (0.75 as shipped), so a hot prefix's burst
finds its holder overloaded and about half of it goes to the other replica, while Serve's own
cap (16) leaves the holder room for the peers' `export_kv` calls. Per run: prompt tokens
served from cache (local or pulled, the engines' own count in each usage) over the best
possible (each prefix computed once in the cluster), the fraction of repeats that landed on a
replica other than the prefix's first, TTFT p50 of "cross" requests (the first of their prefix
on their replica while another replica already finished one: pulled with pull on, recomputed
with it off) and of first computations, and the replicas' transfer counters.

``bandwidth`` times the per-rank byte path of a pull in process (read the blocks out of the
pool with their checksums, pickle and unpickle them as Ray's object store would, verify and
write them into another pool) for the default model's KV geometry, per block size and tier;
the Serve run's own measured pull bandwidth (`pagedserve_kv_transfer_bandwidth_bytes_per_second`)
is reported with it. ``--quick`` runs a smaller load (8 prefixes of 512 tokens, 4 repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import pickle
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
import yaml

from benchmarks.load import Job, one_request
from benchmarks.ports import free_port
from benchmarks.serving import CONFIG, stdout_to_stderr

TAIL_TOKENS = 32


@dataclass
class Sent:
    prefix: int
    started: float
    finished: float
    served_by: str
    cached: int
    prompt: int
    ttft: float | None


def workload(
    rng: random.Random, prefixes: int, tokens: int, repeats: int
) -> list[tuple[int, list[int]]]:
    """The first request of every prefix (shuffled), then each prefix's other repeats back to
    back (prefixes shuffled): a hot prefix's burst finds its holder busy."""
    heads = [[rng.randrange(3, 250) for _ in range(tokens)] for _ in range(prefixes)]
    firsts = list(range(prefixes))
    rng.shuffle(firsts)
    bursts = list(range(prefixes))
    rng.shuffle(bursts)
    order = firsts + [p for p in bursts for _ in range(repeats - 1)]
    return [(i, heads[i] + [rng.randrange(3, 250) for _ in range(TAIL_TOKENS)]) for i in order]


async def drive(
    base: str, model: str, prompts: list[tuple[int, list[int]]], concurrency: int
) -> list[Sent]:
    queue: asyncio.Queue[tuple[int, list[int]]] = asyncio.Queue()
    for item in prompts:
        queue.put_nowait(item)
    sent: list[Sent] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            prefix, ids = queue.get_nowait()
            started = time.perf_counter()
            result = await one_request(client, model, Job(ids, 2))
            sent.append(
                Sent(
                    prefix,
                    started,
                    time.perf_counter(),
                    result.served_by,
                    result.cached_tokens,
                    result.prompt_tokens,
                    result.ttft if result.ok else None,
                )
            )

    headers = {"Authorization": "Bearer bench-key"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return sent


def classify(sent: list[Sent]) -> dict[str, list[Sent]]:
    """first: no request of its prefix had finished anywhere when it started; cross: the first of
    its prefix on its replica while one had finished on another replica; local: the rest."""
    groups: dict[str, list[Sent]] = {"first": [], "cross": [], "local": []}
    for r in sent:
        same = [o for o in sent if o.prefix == r.prefix and o is not r]
        done_before = [o for o in same if o.finished <= r.started]
        mine_before = [o for o in same if o.served_by == r.served_by and o.started < r.started]
        if not done_before:
            groups["first"].append(r)
        elif not mine_before and any(o.served_by != r.served_by for o in done_before):
            groups["cross"].append(r)
        else:
            groups["local"].append(r)
    return groups


def p50(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), 4) if kept else None


def run_summary(sent: list[Sent], block_size: int, prefix_tokens: int) -> dict[str, Any]:
    seen: set[int] = set()
    best = 0
    for r in sorted(sent, key=lambda r: r.started):
        if r.prefix in seen:
            best += prefix_tokens - prefix_tokens % block_size
        seen.add(r.prefix)
    total = sum(r.prompt for r in sent)
    cached = sum(r.cached for r in sent)
    first_replica: dict[int, str] = {}
    for r in sorted(sent, key=lambda r: r.started):
        first_replica.setdefault(r.prefix, r.served_by)
    repeats = [
        r
        for r in sent
        if r is not min((o for o in sent if o.prefix == r.prefix), key=lambda o: o.started)
    ]
    groups = classify(sent)
    return {
        "requests": len(sent),
        "failures": sum(1 for r in sent if not r.prompt),
        "cached_fraction": round(cached / max(1, total), 4),
        "best_possible_cached_fraction": round(best / max(1, total), 4),
        "of_best_possible": round(cached / max(1, best), 4),
        "repeats_on_other_replica": round(
            sum(1 for r in repeats if r.served_by != first_replica[r.prefix])
            / max(1, len(repeats)),
            3,
        ),
        "cross_requests": len(groups["cross"]),
        "cross_cached_tokens_mean": round(statistics.mean(r.cached for r in groups["cross"]), 1)
        if groups["cross"]
        else None,
        "ttft_p50_s": {name: p50([r.ttft for r in rs]) for name, rs in groups.items()},
    }


def transfer_counters(app: str, replicas: set[str]) -> dict[str, Any]:
    from ray import serve

    from cluster.serving.serve_app import DEPLOYMENT_NAME

    engine = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app)
    out: dict[str, Any] = {}
    for replica in sorted(r for r in replicas if r):
        replica_id, metrics = engine.metrics.remote(target_replica=replica).result()
        counters = metrics.kv_transfer
        if counters is None:
            continue
        out[replica_id] = {
            "pulls": counters.pulls,
            "pulled_blocks": counters.pulled_blocks,
            "pulled_bytes": counters.pulled_bytes,
            "declined": counters.declined,
            "fallbacks": dict(counters.fallbacks),
            "exports": counters.exports,
            "pull_seconds_mean": round(counters.pull_seconds.mean or 0.0, 4),
            "bandwidth_bytes_per_s": {
                h: round(v) for h, v in counters.bandwidth_bytes_per_s.items()
            },
        }
    return out


def spreading(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from cluster.engine.config import EngineConfig
    from cluster.serving.routing import ROUTER_CLASS_PATH
    from cluster.serving.serve_app import bind_app

    config = yaml.safe_load(CONFIG.read_text())
    base_args = copy.deepcopy(config["applications"][0]["args"])
    base_args["api_keys"] = {"bench-key": "bench"}
    block_size = EngineConfig.build(base_args["engine"]).cache.block_size
    prompts = workload(random.Random(args.seed), args.prefixes, args.prefix_tokens, args.repeats)
    port = free_port()
    results: dict[str, Any] = {}
    with stdout_to_stderr():
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            for label, pull in (("pull_on", True), ("pull_off", False)):
                app_args = copy.deepcopy(base_args)
                app_args["kv_transfer"] = {"pull": pull}
                app = bind_app(
                    app_args,
                    engine_options={
                        "num_replicas": 2,
                        "ray_actor_options": {"num_cpus": 0},
                        "max_ongoing_requests": 16,
                        "request_router_config": RequestRouterConfig(
                            request_router_class=ROUTER_CLASS_PATH,
                            request_router_kwargs={"overload_fraction": args.overload_fraction},
                        ),
                    },
                    ingress_options={"ray_actor_options": {"num_cpus": 0}},
                )
                name = f"kvpull-{label}"
                serve.run(app, name=name, route_prefix=f"/{label}")
                began = time.perf_counter()
                sent = asyncio.run(
                    drive(
                        f"http://127.0.0.1:{port}/{label}",
                        base_args["served_model_name"],
                        prompts,
                        args.concurrency,
                    )
                )
                results[label] = run_summary(sent, block_size, args.prefix_tokens)
                results[label]["wall_s"] = round(time.perf_counter() - began, 1)
                results[label]["replicas"] = transfer_counters(name, {r.served_by for r in sent})
                serve.delete(name)
                print(json.dumps({label: results[label]}), file=sys.stderr, flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()
    on, off = results["pull_on"], results["pull_off"]
    results["ratios"] = {
        "cross_ttft_p50_pulled_over_recomputed": (
            round(on["ttft_p50_s"]["cross"] / off["ttft_p50_s"]["cross"], 3)
            if on["ttft_p50_s"]["cross"] and off["ttft_p50_s"]["cross"]
            else None
        ),
        "cached_fraction_on_over_off": round(
            on["cached_fraction"] / max(off["cached_fraction"], 1e-9), 3
        ),
    }
    results["config"] = {
        "prefixes": args.prefixes,
        "prefix_tokens": args.prefix_tokens,
        "repeats": args.repeats,
        "tail_tokens": TAIL_TOKENS,
        "concurrency": args.concurrency,
        "router_overload_fraction": args.overload_fraction,
        "block_size": block_size,
    }
    return results


def bandwidth(blocks: int, repeats: int) -> dict[str, Any]:
    """The per-rank byte path of a pull, in process, for SmolLM2-135M's KV geometry."""
    import torch

    from pagedserve_kernels import allocate_kv_pool
    from workers.block_io import read_from_tiers, write_blocks
    from workers.cpu_features import auto_dtype

    dtype = getattr(torch, auto_dtype("cpu"))
    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "blocks_per_pull": blocks}
    for block_size in (8, 16, 32):
        pools = [
            allocate_kv_pool(
                num_layers=30,
                num_blocks=blocks * 2,
                block_size=block_size,
                num_kv_heads=3,
                head_dim=64,
                dtype=dtype,
                device=torch.device("cpu"),
            )
            for _ in range(3)
        ]
        source, cpu_tier, target = pools
        source.normal_()
        cpu_tier.normal_()
        for tier in ("device", "cpu"):
            chosen = list(range(0, blocks * 2, 2))
            seconds = []
            for _ in range(repeats):
                began = time.perf_counter()
                shard = read_from_tiers(source, cpu_tier, [(tier, b) for b in chosen], {})
                shard = pickle.loads(pickle.dumps(shard, protocol=5))
                written = write_blocks(target, list(range(blocks)), shard)
                seconds.append(time.perf_counter() - began)
                assert written == blocks
            moved = shard.num_bytes
            best = min(seconds)
            out[f"block_size_{block_size}_{tier}"] = {
                "bytes_per_block": moved // blocks,
                "seconds_per_pull": round(best, 4),
                "bytes_per_s": round(moved / best),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="8 prefixes of 512 tokens, 4 repeats")
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--overload-fraction",
        type=float,
        default=0.2,
        help="the router's overload threshold, of 16 ongoing requests per engine replica",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-load", action="store_true", help="only the bandwidth figures")
    args = parser.parse_args(argv)
    if args.quick:
        args.prefixes, args.prefix_tokens, args.repeats = 8, 512, 4
    report: dict[str, Any] = {"bandwidth": bandwidth(64, 5)}
    if not args.skip_load:
        report["spreading"] = spreading(args)
    text = json.dumps(report, indent=None if args.json else 2)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
