"""Serving benchmark: a Poisson load generator against the OpenAI-compatible HTTP API.

``python -m benchmarks.serving --json`` starts a local Ray cluster with the application of
``cluster/serving/serve_config.yaml`` (SmolLM2-135M-Instruct on CPU unless ``--model`` names another
model), deployed twice: as shipped, and with prefix caching off. With ``--url`` it drives a server
that is already running instead (then the no-cache run is skipped). Seeded workloads, each sent at
the same Poisson arrival rate:

- ``mixed``: prompts of 8-200 words (long-tailed) and 8-64 output tokens;
- ``shared_prefix``: one 150-word system prefix plus a short unique question, 8-64 output tokens,
  sent to the app as shipped and (``shared_prefix_no_prefix_cache``) to the one without caching.

Each request streams (`stream: true`, usage in the last chunk). Per run it reports TTFT (arrival to
first text), TPOT (mean time per output token after the first) and inter-token latency (gaps
between streamed chunks) as mean/p50/p99, request and output-token throughput, the fraction of
prompt tokens served from the prefix cache (from the usage), and goodput: requests per second that
met both ``--ttft-slo`` and ``--tpot-slo``. ``ratios`` compares runs measured side by side in the
same process: cached over uncached on the shared-prefix workload, and shared-prefix over mixed.
A progress bar goes to stderr; ``--plot FILE.png`` saves latency CDFs when matplotlib is installed.

``--routing-replicas N`` (local cluster only; 2 by default, 0 skips it) also measures prefix
routing through the KV directory against Serve's default router on N engine replicas, over the
default HTTP path (see ``benchmarks/prefix_routing.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from benchmarks.load import Job, Result, run_workload
from benchmarks.ports import free_port
from benchmarks.prefix_routing import routing_comparison

CONFIG = Path(__file__).resolve().parent.parent / "cluster" / "serving" / "serve_config.yaml"
VOCABULARY_TEXT = (
    "the of and to in is was for on that with as by at from his her an be this which are were "
    "river mountain engine memory block cache token kernel paper garden window music number"
)
WORDS = tuple(VOCABULARY_TEXT.split())


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def mixed_workload(rng: random.Random, count: int) -> list[Job]:
    return [
        Job(words(rng, min(200, 8 + int(rng.paretovariate(1.2) * 10))), rng.randint(8, 64))
        for _ in range(count)
    ]


def shared_prefix_workload(rng: random.Random, count: int) -> list[Job]:
    prefix = "You are a careful assistant. " + words(random.Random(12345), 150) + "\n"
    return [
        Job(prefix + "Question: " + words(rng, rng.randint(4, 12)) + "?", rng.randint(8, 64))
        for _ in range(count)
    ]


def summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "p50": ordered[len(ordered) // 2],
        "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
    }


def report(
    results: list[Result], elapsed: float, ttft_slo: float, tpot_slo: float
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    tpots = [t for r in done if (t := r.tpot) is not None]
    good = [r for r in done if r.ttft <= ttft_slo and (r.tpot or 0.0) <= tpot_slo]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    return {
        "requests": len(results),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "elapsed_s": elapsed,
        "ttft_s": summary([r.ttft for r in done]),
        "tpot_s": summary(tpots),
        "itl_s": summary([g for r in done for g in r.gaps]),
        "request_throughput_rps": len(done) / elapsed,
        "output_token_throughput_tps": sum(r.output_tokens for r in done) / elapsed,
        "prefix_cached_fraction": sum(r.cached_tokens for r in done) / max(1, prompt_tokens),
        "goodput_rps": len(good) / elapsed,
        "slo_attainment": len(good) / max(1, len(results)),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


@contextmanager
def local_server(
    model: str | None, routing: dict[str, Any] | None = None
) -> Iterator[tuple[dict[str, str], str, str]]:
    """Ray + the application of cluster/serving/serve_config.yaml twice on one free port: with
    prefix caching (route "/") and without it ("/nocache").
    Yields ({target: url}, model name, key)."""
    import copy

    import ray
    from ray import serve

    from cluster.serving.serve_app import bind_app, build_app

    config = yaml.safe_load(CONFIG.read_text())
    args = copy.deepcopy(config["applications"][0]["args"])
    if model is not None:
        args["engine"]["model"]["model"] = model
    args["api_keys"] = {"bench-key": "bench"}
    no_cache = copy.deepcopy(args)
    no_cache["engine"].setdefault("cache", {})["enable_prefix_caching"] = False
    port = free_port()
    with stdout_to_stderr():  # Ray's own messages must not mix into the JSON on stdout
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            no_cpu = {"ray_actor_options": {"num_cpus": 0}}
            for name, route, app_args in (
                ("pagedserve", "/", args),
                ("pagedserve-nocache", "/nocache", no_cache),
            ):
                build_app(app_args)  # validates
                graph = bind_app(app_args, engine_options=no_cpu, ingress_options=no_cpu)
                serve.run(graph, name=name, route_prefix=route)
            base = f"http://127.0.0.1:{port}"
            targets = {"prefix_cache": base, "no_prefix_cache": f"{base}/nocache"}
            if routing is not None:
                routing.update(
                    routing_comparison(args, base, "bench-key", **routing.pop("request"))
                )
            yield targets, args["served_model_name"], "bench-key"
        finally:
            serve.shutdown()
            ray.shutdown()


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Points file descriptor 1 at stderr for the block (C-level and Python writes alike)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def plot(path: Path, runs: dict[str, list[Result]]) -> None:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    metrics: list[tuple[str, Callable[[Result], float | None]]] = [
        ("TTFT (s)", lambda r: r.ttft),
        ("TPOT (s)", lambda r: r.tpot),
    ]
    for axis, (name, metric) in zip(axes, metrics, strict=True):
        for label, results in runs.items():
            values = sorted(v for r in results if r.ok and (v := metric(r)) is not None)
            axis.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
        axis.set_xlabel(name)
        axis.set_ylabel("CDF")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server; default: start a local one")
    parser.add_argument("--model", help="served model name (with --url) or engine model path")
    parser.add_argument("--api-key", default="none", help="with --url")
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    parser.add_argument("--num-requests", type=int, default=24, help="per workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="seconds, for goodput")
    parser.add_argument("--tpot-slo", type=float, default=0.25, help="seconds, for goodput")
    parser.add_argument("--plot", type=Path, help="save TTFT/TPOT CDFs to this PNG")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--routing-replicas", type=int, default=2, help="0: skip routing")
    parser.add_argument("--routing-prefixes", type=int, default=16)
    parser.add_argument("--routing-concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    if args.routing_replicas and args.url:
        parser.error("--routing-replicas starts its own replicas: not with --url")
    if args.rate <= 0 or args.num_requests <= 0:
        parser.error("--rate and --num-requests must be positive")

    workloads = {
        "mixed": mixed_workload(random.Random(args.seed), args.num_requests),
        "shared_prefix": shared_prefix_workload(random.Random(args.seed + 1), args.num_requests),
    }
    runs: dict[str, list[Result]] = {}
    reports: dict[str, Any] = {}

    def drive(targets: dict[str, str], model: str, key: str) -> None:
        plan = [("mixed", "prefix_cache"), ("shared_prefix", "prefix_cache")]
        if "no_prefix_cache" in targets:
            plan.append(("shared_prefix", "no_prefix_cache"))
        for workload, target in plan:
            label = workload if target == "prefix_cache" else f"{workload}_{target}"
            results, elapsed = asyncio.run(
                run_workload(
                    targets[target], model, key, workloads[workload], args.rate, args.seed, label
                )
            )
            runs[label] = results
            reports[label] = report(results, elapsed, args.ttft_slo, args.tpot_slo)

    if args.url:
        target = {"prefix_cache": args.url.rstrip("/")}
        drive(target, args.model or "SmolLM2-135M-Instruct", args.api_key)
    else:
        routing: dict[str, Any] | None = None
        if args.routing_replicas > 0:
            routing = {
                "request": {
                    "replicas": args.routing_replicas,
                    "prefixes": args.routing_prefixes,
                    "concurrency": args.routing_concurrency,
                    "seed": args.seed,
                }
            }
        with local_server(args.model, routing) as (targets, model, key):
            drive(targets, model, key)
        if routing is not None:
            reports["routing"] = routing

    def compare(a: str, b: str, *path: str) -> float | None:
        if a not in reports or b not in reports:
            return None
        x, y = reports[a], reports[b]
        for part in path:
            x, y = x[part], y[part]
        return ratio(x, y)

    cold = "shared_prefix_no_prefix_cache"
    output = {
        "benchmark": "serving",
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
        "workloads": reports,
        "ratios": {
            "shared_prefix_cached_over_uncached_ttft_mean": compare(
                "shared_prefix", cold, "ttft_s", "mean"
            ),
            "shared_prefix_cached_over_uncached_goodput": compare(
                "shared_prefix", cold, "goodput_rps"
            ),
            "shared_prefix_over_mixed_ttft_mean": compare(
                "shared_prefix", "mixed", "ttft_s", "mean"
            ),
            "shared_prefix_over_mixed_tpot_mean": compare(
                "shared_prefix", "mixed", "tpot_s", "mean"
            ),
            "prefix_routing_over_power_of_two_cached_fraction": ratio(
                reports.get("routing", {}).get("prefix_aware", {}).get("cached_fraction"),
                reports.get("routing", {}).get("power_of_two", {}).get("cached_fraction"),
            ),
            "prefix_routing_of_best_possible": reports.get("routing", {})
            .get("prefix_aware", {})
            .get("of_best_possible"),
        },
    }
    if args.plot:
        plot(args.plot, runs)
    if args.json:
        print(json.dumps(output, indent=2))
    else:
        for label, data in reports.items():
            if label == "routing":
                print(f"routing: {json.dumps(data)}")
                continue
            ttft, tpot = data["ttft_s"]["p50"], data["tpot_s"]["p50"]
            print(
                f"{label:>14}: TTFT p50 {ttft} s, TPOT p50 {tpot} s, goodput "
                f"{data['goodput_rps']:.2f} req/s, "
                f"prefix-cached {data['prefix_cached_fraction']:.0%}"
            )
        print(json.dumps(output["ratios"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
