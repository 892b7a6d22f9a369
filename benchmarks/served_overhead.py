"""What serving costs over the engine: the same saturating burst in process and through HTTP.

``python -m benchmarks.served_overhead --json`` renders `--requests` natural-text chats
(``benchmarks.chat_corpus``) to token ids once, then runs them with `--max-tokens` output tokens
each (greedy, ``ignore_eos``) on every side, with the engine settings `pagedserve serve` deploys
with ``--serve-args`` (the shipped Serve config by default; the same flags on every side, so an
A/B of a flag compares like with like):

- in process: ``LLM(config=...)`` with every request submitted at once;
- the replica's engine in process: ``AsyncEngine`` (what an engine replica runs) with every
  request streamed at once at the shipped ``stream_interval`` and ``stream_chunks_per_step``,
  timed as a client would time its chunks, without Ray, Serve or HTTP;
- the front end in process: the ingress's HTTP routes over that engine in one process, without
  Ray (``benchmarks.front_end_server``), every request sent at once as below;
- served: ``pagedserve serve`` as shipped (proxy, ingress and one engine replica on this
  machine), every request sent at once as a streaming ``/v1/completions`` call with the same
  token ids.

Both sides are saturated the same way (the burst exceeds ``max_num_seqs``), so a request's
TPOT is the decode step time of a full batch plus what its side adds per token. It prints each
side's output tok/s and TPOT p50 and ``served_tpot_over_in_process`` (the served step over the
same step in process; the goal is <= 1.15) and ``served_tok_s_over_in_process``, split in two:
``async_engine_tpot_over_in_process`` (the asyncio engine and its streams) and
``served_tpot_over_async_engine`` (the processes around it: Ray, Serve, the ingress, HTTP), and
again as ``front_end_tpot_over_in_process`` (HTTP, SSE and the client, in one process) and
``served_tpot_over_front_end`` (what Ray Serve's processes and hops add to those).

``--forward-threads N [M ...]`` runs the whole comparison once per value with the forward pass
on N torch threads on every side (``--num-threads N``, the engine's ``parallel.num_threads``;
``auto`` is every core) and one engine replica, reported under ``by_forward_threads``: on 2
cores ``1 auto`` gives the serving processes a core of their own, then has them contend with
the forward pass for both. Each comparison reports the load average around its sides.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import llama_server
from benchmarks.chat_corpus import chat_prompts
from benchmarks.load import Job, Result, run_workload
from benchmarks.ports import free_port
from benchmarks.serving import ratio
from cluster.engine.config import EngineConfig
from cluster.serving.app_args import ServeAppArgs
from cluster.serving.cli_serve import served_app_args

MODEL_NAME = "SmolLM2-135M-Instruct"
NOT_RUN: dict[str, Any] = {"tpot_p50_ms": None, "output_tok_s": None}
"""What a side skipped by `--served-only` / `--in-process-only` reports (read, never changed)."""


def side_ratio(side: dict[str, Any], base: dict[str, Any], key: str) -> float | None:
    """`side[key] / base[key]`, rounded; None when either side did not run."""
    return rounded(ratio(side[key], base[key]))


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def render_chats(config: EngineConfig, chats: list[list[dict[str, str]]]) -> list[list[int]]:
    """The token ids the engine renders for each chat: what both sides are sent."""
    from cluster.engine.tokenization import PromptRenderer
    from workers import load_tokenizer

    tokenizer = load_tokenizer(config.model.model)
    renderer = PromptRenderer(tokenizer, len(tokenizer))
    return [renderer.render_chat(chat).token_ids for chat in chats]


def run_in_process(
    config: EngineConfig, prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    """The burst through `LLM.generate`."""
    from pagedserve import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(config=config) as llm:
        llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts[:4]], SamplingParams(max_tokens=8)
        )
        began = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy)
        elapsed = time.perf_counter() - began
        tokens = sum(len(r.outputs[0].token_ids) for r in results)
        tpots = []
        for result in results:
            metrics, count = result.metrics, len(result.outputs[0].token_ids)
            if metrics.first_token_time is not None and metrics.finished_time and count > 1:
                tpots.append((metrics.finished_time - metrics.first_token_time) / (count - 1))
        return {
            "elapsed_s": round(elapsed, 2),
            "output_tok_s": round(tokens / elapsed, 1),
            "tpot_p50_ms": round(p50(tpots) * 1e3, 2) if tpots else None,
            "dtype": llm.engine.model_info.dtype,
        }


def run_async_engine(
    config: EngineConfig, prompts: list[list[int]], max_tokens: int, app: ServeAppArgs
) -> dict[str, Any]:
    """The burst through `AsyncEngine.generate` in this process, each stream read as it comes
    (TTFT and TPOT from when its deltas arrive, as the HTTP client times its chunks)."""
    from cluster.engine.async_engine import AsyncEngine
    from pagedserve import SamplingParams

    async def one(engine: AsyncEngine, ids: list[int], params: SamplingParams) -> Result:
        request = engine.request_builder.build({"prompt_token_ids": ids}, params)
        began = time.perf_counter()
        result = Result(ok=True)
        async for delta in engine.generate(
            request, app.stream_interval, app.stream_chunks_per_step
        ):
            new = max((len(branch.token_ids) for branch in delta.branches), default=0)
            if new and not result.output_tokens:
                result.ttft = time.perf_counter() - began
            result.output_tokens += new
        result.latency = time.perf_counter() - began
        return result

    async def burst() -> tuple[list[Result], float]:
        engine = await AsyncEngine.create(config)
        try:
            warm = SamplingParams(max_tokens=8)
            await asyncio.gather(*(one(engine, ids, warm) for ids in prompts[:4]))
            greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            began = time.perf_counter()
            results = await asyncio.gather(*(one(engine, ids, greedy) for ids in prompts))
            return results, time.perf_counter() - began
        finally:
            await engine.shutdown()

    results, elapsed = asyncio.run(burst())
    tpots = [r.tpot for r in results if r.tpot is not None]
    return {
        "stream_interval": app.stream_interval,
        "stream_chunks_per_step": app.stream_chunks_per_step,
        "elapsed_s": round(elapsed, 2),
        "output_tok_s": round(sum(r.output_tokens for r in results) / elapsed, 1),
        "tpot_p50_ms": round(p50(tpots) * 1e3, 2) if tpots else None,
    }


def serve_command(port: int, extra: Sequence[str] = ()) -> list[str]:
    """`pagedserve serve` as shipped, HTTP on `port` (gRPC on a free port), `extra` flags last."""
    command = [sys.executable, "-m", "cluster.serving.cli", "serve", "--host", "127.0.0.1"]
    return [*command, "--http-port", str(port), "--grpc-port", str(free_port()), *extra]


@contextlib.contextmanager
def http_server(
    command: list[str], port: int, ready_s: float
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The server `command` starts on `port` (a new local Ray cluster if it starts one), and its
    base URL, once /v1/models answers; stopped on exit."""
    env = {**os.environ, "RAY_ADDRESS": "local"}
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="served-overhead-")) / "server.log"
    with llama_server.server_process(command, f"{url}/v1/models", log, ready_s, env) as process:
        yield process, url


def run_http_burst(
    command: list[str], port: int, prompts: list[list[int]], max_tokens: int, ready_s: float
) -> dict[str, Any]:
    """The same token ids, all at once, through the HTTP server `command` starts on `port`."""
    jobs = [Job(ids, max_tokens) for ids in prompts]
    with http_server(command, port, ready_s) as (_, url):
        asyncio.run(run_workload(url, MODEL_NAME, "none", jobs[:4], math.inf, 0, "warm-up"))
        results, elapsed = asyncio.run(
            run_workload(url, MODEL_NAME, "none", jobs, math.inf, 0, "served")
        )
    ok = [r for r in results if r.ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    return {
        "command": " ".join(command),
        "elapsed_s": round(elapsed, 2),
        "output_tok_s": round(sum(r.output_tokens for r in ok) / elapsed, 1),
        "tpot_p50_ms": round(p50(tpots) * 1e3, 2) if tpots else None,
        "failed": len(results) - len(ok),
    }


def run_front_end(
    prompts: list[list[int]], max_tokens: int, serve_args: list[str], ready_s: float
) -> dict[str, Any]:
    """The burst through the ingress's HTTP routes over the engine in one process, no Ray."""
    port = free_port()
    command = [sys.executable, "-m", "benchmarks.front_end_server", "--port", str(port)]
    command += ["--serve-args", *serve_args]
    return run_http_burst(command, port, prompts, max_tokens, ready_s)


def run_served(
    prompts: list[list[int]], max_tokens: int, serve_args: list[str], ready_s: float
) -> dict[str, Any]:
    """The burst through `pagedserve serve` as shipped."""
    port = free_port()
    command = serve_command(port, serve_args)
    return run_http_burst(command, port, prompts, max_tokens, ready_s)


def with_forward_threads(serve_args: list[str], threads: str | None) -> list[str]:
    """`serve_args` with the engine's CPU threads (`parallel.num_threads`, the `--num-threads`
    flag) set to `threads` on every side, and one engine replica (with fewer threads than
    cores `pagedserve serve` would let the autoscaler start a second engine on the cores left
    to the serving processes); None leaves the config's."""
    if threads is None:
        return serve_args
    return [*serve_args, "--num-threads", threads, "--replicas", "1"]


def compare_sides(
    serve_args: list[str], chats: list[list[dict[str, str]]], args: argparse.Namespace
) -> dict[str, Any]:
    """Every side on the same burst with the engine settings of `serve_args`, and the ratios."""
    app = served_app_args(serve_args)
    config = app.engine_config()
    prompts = render_chats(config, chats)
    in_process = async_engine = front_end = served = NOT_RUN
    load = {"start": os.getloadavg()}
    if not args.served_only:
        in_process = run_in_process(config, prompts, args.max_tokens)
        async_engine = run_async_engine(config, prompts, args.max_tokens, app)
        load["after_in_process"] = os.getloadavg()
    if not (args.served_only or args.in_process_only):
        front_end = run_front_end(prompts, args.max_tokens, serve_args, args.ready_timeout)
    if not args.in_process_only:
        served = run_served(prompts, args.max_tokens, serve_args, args.ready_timeout)
        load["after_served"] = os.getloadavg()
    resolved = config.resolved()
    return {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "max_num_seqs": resolved.scheduler.max_num_seqs,
        "forward_threads": resolved.parallel.num_threads,
        "load_average": load,
        "in_process": in_process,
        "async_engine": async_engine,
        "front_end": front_end,
        "served": served,
        "served_tpot_over_in_process": side_ratio(served, in_process, "tpot_p50_ms"),
        "served_tok_s_over_in_process": side_ratio(served, in_process, "output_tok_s"),
        "async_engine_tpot_over_in_process": side_ratio(async_engine, in_process, "tpot_p50_ms"),
        "served_tpot_over_async_engine": side_ratio(served, async_engine, "tpot_p50_ms"),
        "front_end_tpot_over_in_process": side_ratio(front_end, in_process, "tpot_p50_ms"),
        "served_tpot_over_front_end": side_ratio(served, front_end, "tpot_p50_ms"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--served-only", action="store_true", help="only the served side (A/B of serve flags)"
    )
    only.add_argument(
        "--in-process-only",
        action="store_true",
        help="only the in-process sides (no server started)",
    )
    parser.add_argument(
        "--serve-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="`serve` flags for every side (last)",
    )
    parser.add_argument(
        "--forward-threads",
        nargs="+",
        metavar="N",
        help="run the whole comparison once per value with the engine's forward pass on N "
        "threads on every side (`--num-threads N`; 'auto' = every core); e.g. `1 auto` on 2 "
        "cores: the serving processes with a core of their own, then contending for both",
    )
    args = parser.parse_args(argv)
    chats = chat_prompts(args.requests, args.seed)
    if not args.forward_threads:
        out = compare_sides(args.serve_args, chats, args)
    else:
        out = {
            "by_forward_threads": {
                threads: compare_sides(with_forward_threads(args.serve_args, threads), chats, args)
                for threads in args.forward_threads
            }
        }
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
