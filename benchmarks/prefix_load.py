"""Shared-prefix load spread over two engine replicas by force, every failure named.

``python -m benchmarks.prefix_load --json`` starts `pagedserve serve --replicas 2` (the shipped
model unless ``--model DIR``) with the engine deployment as benchmarks/kv_transfer.py sets it
to spread repeats: 16 ongoing requests per replica, the router counting a replica overloaded
from ``--overload-fraction`` (0.2) of them, so a hot prefix's repeats go to the other replica
too and pull its blocks. It sends that benchmark's prompts (``--prefixes`` prefixes of
``--prefix-tokens`` token ids, ``--repeats`` requests each: the first of every prefix, then
each prefix's repeats back to back) as a Poisson arrival at ``--rate`` per second, streamed,
``--max-tokens`` each, and reports how many completed and every other outcome by kind: HTTP
status with the error's code and message (a 503's Retry-After too), an error event inside the
stream, or a transport error. The goal: nothing but completions and 503s with Retry-After.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from collections import Counter
from typing import Any

import httpx

from benchmarks.kv_transfer import workload
from benchmarks.reliability_server import LocalServer, derived_config, tiny_engine
from cluster.serving.routing import ROUTER_CLASS_PATH


def error_kind(status: int, body: bytes, headers: httpx.Headers) -> str:
    """'HTTP 503 engine_overloaded Retry-After=4: <message>' and the like."""
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        error = {"message": body[:120].decode(errors="replace")}
    retry = f" Retry-After={headers['retry-after']}" if "retry-after" in headers else ""
    return f"HTTP {status} {error.get('code')}{retry}: {str(error.get('message'))[:160]}"


async def one(client: httpx.AsyncClient, model: str, ids: list[int], max_tokens: int) -> str:
    """'ok', or what went wrong (see `error_kind`)."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return error_kind(response.status_code, await response.aread(), response.headers)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    error = chunk["error"]
                    return f"stream error {error.get('code')}: {str(error.get('message'))[:160]}"
    except httpx.HTTPError as error:
        return f"transport {type(error).__name__}: {str(error)[:120]}"
    return "ok"


async def drive(args: argparse.Namespace, base: str, model: str, outcomes: list[str]) -> None:
    """Sends the workload; each request's outcome is appended to `outcomes` as it ends."""
    rng = random.Random(args.seed + 1)
    sent = workload(random.Random(args.seed), args.prefixes, args.prefix_tokens, args.repeats)
    limits = httpx.Limits(max_connections=len(sent))

    async def record(client: httpx.AsyncClient, ids: list[int]) -> None:
        outcomes.append(await one(client, model, ids, args.max_tokens))

    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        tasks = []
        for _, ids in sent:
            tasks.append(asyncio.create_task(record(client, ids)))
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)


def summary(outcomes: list[str], requests: int, seconds: float) -> dict[str, Any]:
    counts = Counter(outcomes)
    return {
        "requests": requests,
        "completed": counts.pop("ok", 0),
        "unfinished": requests - len(outcomes),
        "seconds": round(seconds, 1),
        "failures": dict(counts.most_common()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model", default=None, help="a model directory (default: shipped)")
    parser.add_argument("--served-name", default="SmolLM2-135M-Instruct")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--overload-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--time-limit", type=float, default=None, help="seconds; then report what ended"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    server = None
    base, model = args.url, args.served_name
    if base is None:
        engine = tiny_engine(args.model) if args.model else None
        spread = {
            "max_ongoing_requests": 16,
            "request_router_config": {
                "request_router_class": ROUTER_CLASS_PATH,
                "request_routing_stats_period_s": 1.0,
                "request_router_kwargs": {"overload_fraction": args.overload_fraction},
            },
        }
        config = derived_config(engine=engine, limits=None, engine_deployment=spread)
        server = LocalServer(config, replicas=args.replicas)
        server.start()
        base = server.base
        if args.model:
            model = args.model
    outcomes: list[str] = []
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server on the way out
    try:
        asyncio.run(asyncio.wait_for(drive(args, base, model, outcomes), args.time_limit))
    except TimeoutError:
        pass  # reported as unfinished
    finally:
        if server is not None:
            server.stop()
            server.kill()
        requests = args.prefixes * args.repeats
        report = summary(outcomes, requests, time.perf_counter() - started)
        print(json.dumps(report, indent=2) if args.json else report, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
