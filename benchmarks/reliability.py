"""Reliability benchmark: the server as shipped (`pagedserve serve --replicas 1`, the shipped
Serve config) tried as a hostile user and an unlucky operator would.

``python -m benchmarks.reliability --json`` starts the server on localhost (``--model`` names
another model than the shipped default, e.g. the test suite's tiny one) and reports, per
scenario, with the KV blocks in use and the RSS growth of the engine and ingress replicas after
it:

- ``fuzz_http`` / ``fuzz_grpc``: Hypothesis-built bad inputs per front end and how many got a
  non-4xx or non-OpenAI body (gRPC: not INVALID_ARGUMENT); goal 0;
- ``huge_prompt``: a 50 MB prompt: its status (413), how fast it was refused, and the worst
  /health latency while it was (an upper bound on the ingress event loop's stall; goal < 0.1 s);
- ``deep_nesting``: a body nested 100,000 levels: status and shape (400);
- ``burst``: 10x the configured capacity (engine `max_ongoing_requests` + `max_queued_requests`)
  at once: 200s, 503s with Retry-After, anything else, TCP connect failures, the slowest 503
  and the slowest answer (bounded by the queue timeout plus one generation);
- ``shutdown``: SIGTERM with streams in flight: exit code, seconds to exit, how the streams
  ended (completed / error event + [DONE] / cut), whether a request sent while draining got a
  JSON 503.

Fault scenarios, each on a server of its own (benchmarks/reliability_faults.py): streaming and
non-stream requests at a fixed rate, SIGKILL to one process, probes until serving resumes:

- ``replica_kill_1`` / ``replica_kill_2``: the busiest engine replica process, with one and two
  engine replicas: how streams and non-stream calls ended, seconds until serving resumed, and
  (two replicas) whether any new request failed meanwhile; ``replica_kill_1`` then stops its
  server with SIGINT and streams in flight (``shutdown_sigint``);
- ``rank_kill_tp2``: one rank of a tensor-parallel degree 2 engine (the model must split in
  two: the tiny one does): seconds until the streams were failed, how, seconds to recover.

``replica_kill_2`` and ``rank_kill_tp2`` then stop their idle server with SIGTERM, and
``idle_stop`` starts one and stops it with SIGINT: exit code, seconds to exit, and whether a
native stack trace was printed (``*_idle_sigterm``, ``idle_sigint``).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict
from typing import Any

from benchmarks.reliability_faults import kill_engine_replica, kill_rank, kill_under_load
from benchmarks.reliability_probes import (
    burst,
    deep_nesting,
    fuzz_grpc,
    fuzz_http,
    huge_prompt_refusal,
    is_openai_error,
    shutdown_under_load,
)
from benchmarks.reliability_server import ENGINE, INGRESS, LocalServer, derived_config

FAULTS = ("replica_kill_1", "replica_kill_2", "rank_kill_tp2")
SCENARIOS = ("edge", *FAULTS, "idle_stop")

MB = 1024 * 1024


def engine_for(model: str | None) -> dict[str, Any] | None:
    if model is None:
        return None  # as shipped
    from benchmarks.reliability_server import tiny_engine

    return tiny_engine(model)


def figures_after(server: LocalServer, rss0: dict[str, int]) -> dict[str, Any]:
    """KV blocks in use once idle (the most any replica answering /metrics reports over a few
    samples) and RSS growth of the engine and ingress processes since `rss0`."""
    used = server.kv_blocks_used()
    for _ in range(5):
        used = max(used, server.kv_blocks_used(wait_s=0))
    rss = server.rss_bytes()
    return {
        "kv_blocks_used_after": used,
        "rss_growth_mb": {
            name: round((rss[name] - rss0[name]) / MB, 1) for name in (ENGINE, INGRESS)
        },
    }


def run_fault(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fault scenario on a server of its own (see the module doc)."""
    engine = engine_for(args.model)
    replicas, kill = 1, kill_engine_replica
    if name == "replica_kill_2":
        replicas = 2
    if name == "rank_kill_tp2":
        if engine is None:
            raise SystemExit("rank_kill_tp2 needs --model (a model that splits over 2 ranks)")
        engine["parallel"] = {"tensor_parallel_size": 2, "backend": "ray"}
        kill = kill_rank
    config = derived_config(engine=engine, limits=None, engine_deployment=None)
    server = LocalServer(config, grace_period_s=args.grace_period, replicas=replicas)
    started = time.monotonic()
    server.start()
    report: dict[str, Any] = {"replicas": replicas, "start_s": round(time.monotonic() - started)}
    try:
        rss0 = server.rss_bytes()
        result = kill_under_load(
            server,
            kill,
            streams=args.fault_streams,
            unary=args.fault_unary,
            rate_per_s=args.fault_rate,
            probe_for_s=8.0 if replicas > 1 else 0.0,
        )
        report[name] = {**asdict(result), **figures_after(server, rss0)}
        if name == "replica_kill_1":
            down = shutdown_under_load(server, signal.SIGINT, 3, 400, None)
            figures = asdict(down)
            figures["seconds_to_exit"] = round(down.seconds_to_exit, 1)
            figures.pop("output_tail")
            report["shutdown_sigint"] = figures
        else:
            report[f"{name}_idle_sigterm"] = idle_stop(server, signal.SIGTERM)
    finally:
        server.stop()
        server.kill()
    return report


def idle_stop(server: LocalServer, signum: int) -> dict[str, Any]:
    """Signals a server with nothing in flight: exit code, seconds to exit, and whether Ray's
    native handler printed a stack trace (what SIGTERM did before the runner handled it)."""
    started = time.monotonic()
    server.signal(signum)
    code = server.wait(120)
    log = server.log_tail(200_000)
    return {
        "signal": signal.Signals(signum).name,
        "exit_code": code,
        "seconds_to_exit": round(time.monotonic() - started, 1),
        "native_stack_trace": "SIGTERM received" in log or "Aborted" in log,
    }


def run_idle_stop(args: argparse.Namespace) -> dict[str, Any]:
    """A server started and stopped with SIGINT (Ctrl-C) with nothing in flight."""
    config = derived_config(engine=engine_for(args.model), limits=None, engine_deployment=None)
    server = LocalServer(config, grace_period_s=args.grace_period)
    server.start()
    try:
        return {"idle_sigint": idle_stop(server, signal.SIGINT)}
    finally:
        server.kill()


def run(args: argparse.Namespace) -> dict[str, Any]:
    ongoing, queued = args.max_ongoing, args.max_queued
    config = derived_config(
        engine=engine_for(args.model),
        limits={"queue_timeout_s": args.queue_timeout},
        engine_deployment={"max_ongoing_requests": ongoing, "max_queued_requests": queued},
    )
    server = LocalServer(config, grace_period_s=args.grace_period)
    started = time.monotonic()
    server.start()
    report: dict[str, Any] = {
        "server": {
            "start_s": round(time.monotonic() - started, 1),
            "model": args.model or "shipped default",
            "engine_max_ongoing_requests": ongoing,
            "engine_max_queued_requests": queued,
            "queue_timeout_s": args.queue_timeout,
            "grace_period_s": args.grace_period,
        }
    }
    rss0 = server.rss_bytes()

    def after(name: str, figures: dict[str, Any]) -> None:
        figures.update(figures_after(server, rss0))
        report[name] = figures
        print(f"{name}: {json.dumps(figures)}", file=sys.stderr)

    try:
        http = fuzz_http(server.base, args.http_cases)
        after(
            "fuzz_http", {"tried": http.tried, "wrong": len(http.wrong), "examples": http.wrong[:5]}
        )
        grpc_result = fuzz_grpc(server.grpc_target, args.grpc_cases)
        after(
            "fuzz_grpc",
            {
                "tried": grpc_result.tried,
                "wrong": len(grpc_result.wrong),
                "examples": grpc_result.wrong[:5],
            },
        )
        huge = huge_prompt_refusal(server.base, 50 * MB)
        after(
            "huge_prompt",
            {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(huge).items()},
        )
        nested = deep_nesting(server.base, 100_000)
        after(
            "deep_nesting", {"status": nested.status_code, "openai_shape": is_openai_error(nested)}
        )
        shed = burst(server.base, 10 * (ongoing + queued), args.max_tokens)
        figures = asdict(shed)
        figures["other"] = figures["other"][:5]
        figures["worst_shed_s"] = round(shed.worst_shed_s, 3)
        figures["worst_any_s"] = round(shed.worst_any_s, 3)
        after("burst", figures)
        down = shutdown_under_load(server, signal.SIGTERM, 4, 400, None)
        figures = asdict(down)
        figures["seconds_to_exit"] = round(down.seconds_to_exit, 1)
        figures.pop("output_tail")
        report["shutdown"] = figures
        print(f"shutdown: {json.dumps(figures)}", file=sys.stderr)
    finally:
        server.stop()
        server.kill()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--model", default=None, help="engine model dir (default: as shipped)")
    parser.add_argument("--http-cases", type=int, default=120)
    parser.add_argument("--grpc-cases", type=int, default=60)
    parser.add_argument("--max-ongoing", type=int, default=4, help="engine max_ongoing_requests")
    parser.add_argument("--max-queued", type=int, default=4, help="engine max_queued_requests")
    parser.add_argument("--queue-timeout", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=32, help="per burst request")
    parser.add_argument("--grace-period", type=float, default=5.0)
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument("--fault-streams", type=int, default=6, help="streams per fault")
    parser.add_argument("--fault-unary", type=int, default=2, help="non-stream calls per fault")
    parser.add_argument("--fault-rate", type=float, default=4.0, help="requests/s before a kill")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    report: dict[str, Any] = {}
    if "edge" in chosen:
        report.update(run(args))
    for name in FAULTS:
        if name in chosen:
            fault = run_fault(name, args)
            print(f"{name}: {json.dumps(fault)}", file=sys.stderr)
            report[f"{name}_server"] = {k: fault.pop(k) for k in ("replicas", "start_s")}
            report.update(fault)
    if "idle_stop" in chosen:
        report.update(run_idle_stop(args))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, figures in report.items():
            print(f"{name}: {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
