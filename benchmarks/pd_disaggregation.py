"""Prefill/decode disaggregation against colocation, on a mixed load, side by side.

``python -m benchmarks.pd_disaggregation --json`` starts a local Ray cluster and deploys, one
after the other on the same cores, two applications of the default model over the default HTTP
path (streamed completions, one token per chunk):
- ``colocated``: the ingress and two engine replicas (prefix-aware routing);
- ``disaggregated``: the ingress, one ``Prefill`` and one ``Decode`` replica
  (cluster/serving/pd_app.py; the decode replica pulls each prompt's blocks).
Each replica gets the same share of the cores (``--threads``). The seeded workload mixes short
chats (``--short`` requests: ``SHORT_PROMPT_TOKENS`` prompt tokens, ``SHORT_OUTPUT_TOKENS``
generated) with long prompts (``--long`` requests of ``LONG_PROMPT_TOKENS`` tokens,
``LONG_OUTPUT_TOKENS`` generated), in shuffled order at Poisson arrivals of ``--rate`` per
second; prompts are token ids, so both runs compute the same tokens.

Per run and per kind (short, long): TTFT, TPOT and inter-token latency (gaps between streamed
chunks) as mean/p50/p99, failures; ``ratios`` divides disaggregated by colocated for the short
chats' ITL p99 and TPOT p50 and both kinds' TTFT p50; ``decode_pulls`` counts what the decode
replica pulled (and the pulls that fell back to computing, by cause). ``--quick`` is a smaller
load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import sys
from typing import Any

from benchmarks.load import Job, Result, run_workload
from benchmarks.ports import free_port
from benchmarks.serving import ratio, stdout_to_stderr, summary

SHORT_PROMPT_TOKENS = 48
SHORT_OUTPUT_TOKENS = 48
LONG_PROMPT_TOKENS = 1500
LONG_OUTPUT_TOKENS = 8
ENGINE_MAX_ONGOING = 256
"""As shipped (cluster/serving/serve_config.yaml): each engine replica takes every request
and queues what it cannot run yet (Serve's default of 5 would cap the batch)."""
MODEL_NAME = "bench"
KEY = "bench-key"


def workload(rng: random.Random, short: int, long: int) -> list[tuple[str, Job]]:
    """(kind, job) in shuffled order, the long prompts spread among the short ones; token ids
    stay below 250 (any vocabulary)."""

    def ids(count: int) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(count)]

    jobs = [("short", Job(ids(SHORT_PROMPT_TOKENS), SHORT_OUTPUT_TOKENS)) for _ in range(short)]
    jobs += [("long", Job(ids(LONG_PROMPT_TOKENS), LONG_OUTPUT_TOKENS)) for _ in range(long)]
    rng.shuffle(jobs)
    return jobs


def engine_args(model: str, threads: int) -> dict[str, Any]:
    return {
        "served_model_name": MODEL_NAME,
        "api_keys": {KEY: "bench"},
        "stream_interval": 1,
        "engine": {
            "model": {"model": model, "max_model_len": 2048},
            "parallel": {"backend": "local", "num_threads": threads},
            "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 256},
        },
    }


def kind_report(results: list[Result]) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    return {
        "requests": len(results),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "ttft_s": summary([r.ttft for r in done]),
        "tpot_s": summary([t for r in done if (t := r.tpot) is not None]),
        "itl_s": summary([g for r in done for g in r.gaps]),
    }


def run_one(
    name: str, graph: Any, port: int, jobs: list[tuple[str, Job]], rate: float, seed: int
) -> dict[str, Any]:
    from ray import serve

    serve.run(graph, name=name, route_prefix=f"/{name}")
    base = f"http://127.0.0.1:{port}/{name}"
    warm = [Job([5, 6, 7, 8], 2)]
    asyncio.run(run_workload(base, MODEL_NAME, KEY, warm, 10.0, seed, f"{name} warm-up"))
    results, elapsed = asyncio.run(
        run_workload(base, MODEL_NAME, KEY, [job for _, job in jobs], rate, seed, name)
    )
    pulls = decode_pulls(name)
    serve.delete(name)
    kinds = [kind for kind, _ in jobs]
    return {
        "elapsed_s": elapsed,
        "decode_pulls": pulls,
        **{
            kind: kind_report([r for r, k in zip(results, kinds, strict=True) if k == kind])
            for kind in ("short", "long")
        },
    }


def decode_pulls(app: str) -> dict[str, Any] | None:
    """The decode replica's pull counters (None for a colocated app)."""
    from ray import serve

    from cluster.serving.pd_args import DECODE_DEPLOYMENT

    if app != "disaggregated":
        return None
    handle = serve.get_deployment_handle(DECODE_DEPLOYMENT, app_name=app)
    counters = handle.metrics.remote().result()[1].kv_transfer
    if counters is None:
        return None
    return {
        "pulls": counters.pulls,
        "pulled_blocks": counters.pulled_blocks,
        "pulled_bytes": counters.pulled_bytes,
        "fallbacks": dict(counters.fallbacks),
    }


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--short", type=int, default=48, help="short chats")
    parser.add_argument("--long", type=int, default=8, help="long prompts")
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="16 short chats, 3 long prompts")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.quick:
        args.short, args.long = 16, 3
    jobs = workload(random.Random(args.seed), args.short, args.long)

    import ray
    from ray import serve

    from cluster.serving.pd_app import build_pd_app
    from cluster.serving.serve_app import bind_app, build_app

    base_args = engine_args(args.model, args.threads)
    no_cpu = {"ray_actor_options": {"num_cpus": 0}}
    engine_options = {"max_ongoing_requests": ENGINE_MAX_ONGOING, **no_cpu}
    side = {"deployment": {"num_replicas": 1, **engine_options}}
    port = free_port()
    runs: dict[str, Any] = {}
    with stdout_to_stderr():
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            build_app(base_args)  # validates
            colocated = bind_app(
                base_args,
                engine_options={"num_replicas": 2, **engine_options},
                ingress_options=no_cpu,
            )
            runs["colocated"] = run_one("colocated", colocated, port, jobs, args.rate, args.seed)
            pd = build_pd_app({**base_args, "prefill": side, "decode": side})
            runs["disaggregated"] = run_one("disaggregated", pd, port, jobs, args.rate, args.seed)
        finally:
            serve.shutdown()
            ray.shutdown()
    colo, pd_run = runs["colocated"], runs["disaggregated"]
    result = {
        "benchmark": "pd_disaggregation",
        "cpu": cpu_model(),
        "settings": {
            "short": args.short,
            "long": args.long,
            "rate": args.rate,
            "threads_per_replica": args.threads,
            "short_tokens": [SHORT_PROMPT_TOKENS, SHORT_OUTPUT_TOKENS],
            "long_tokens": [LONG_PROMPT_TOKENS, LONG_OUTPUT_TOKENS],
            "model": args.model,
            "seed": args.seed,
        },
        "runs": runs,
        "ratios": {
            "short_itl_p99_pd_over_colocated": ratio(
                pd_run["short"]["itl_s"]["p99"], colo["short"]["itl_s"]["p99"]
            ),
            "short_tpot_p50_pd_over_colocated": ratio(
                pd_run["short"]["tpot_s"]["p50"], colo["short"]["tpot_s"]["p50"]
            ),
            "short_ttft_p50_pd_over_colocated": ratio(
                pd_run["short"]["ttft_s"]["p50"], colo["short"]["ttft_s"]["p50"]
            ),
            "long_ttft_p50_pd_over_colocated": ratio(
                pd_run["long"]["ttft_s"]["p50"], colo["long"]["ttft_s"]["p50"]
            ),
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, run in runs.items():
            for kind in ("short", "long"):
                r = run[kind]
                print(
                    f"{name:>14} {kind:>5}: TTFT p50 {r['ttft_s']['p50']} "
                    f"TPOT p50 {r['tpot_s']['p50']} ITL p99 {r['itl_s']['p99']} "
                    f"failed {r['failed']}"
                )
        print(json.dumps(result["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
