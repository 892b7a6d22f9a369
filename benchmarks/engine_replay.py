"""The serving benchmark's random load replayed into an in-process `AsyncEngine` (no Serve, no
HTTP), with the forward pass called two ways side by side.

`python -m benchmarks.engine_replay --json [--rounds 2] [--num-requests 48] [--rate 2]`
runs, per round and per variant in turn, a fresh process that builds one engine from the shipped
Serve config's `engine` section (bfloat16 SmolLM2, 16 sequences, 256-token steps, `num_threads:
auto`) and replays the seeded Poisson load of `benchmarks.vs_llamacpp` (128 random prompt
tokens, 128 greedy output tokens with `ignore_eos`) into it. A process each, because OpenMP
threads outlive the variant that made them: once more OpenMP threads exist than cores, libgomp
stops spinning at barriers for every team in the process. The variants:

- `rank_thread`: as shipped, every torch call on the rank's own thread (`workers.rank_thread`);
- `pool_thread`: each step handed to `asyncio.to_thread`, whichever thread of the event loop's
  default executor is free (the model loaded on another thread).

Per variant (medians over rounds) it reports output tok/s (tokens over the time from the first
arrival to the last token), TTFT and TPOT p50, and the median forward time of decode-only steps
by batch size; the ratios are `rank_thread` over `pool_thread`, runs alternating on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.vs_llamacpp import random_workload
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.generate_request import GenerateRequest
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenization import RenderedPrompt
from cluster.serving.cli_serve import served_app_args
from workers.group import WorkerGroup
from workers.plan import StepOutput, StepPlan

VARIANTS = ("rank_thread", "pool_thread")


@dataclass
class StepLog:
    """Forward seconds of the decode-only steps, by batch size."""

    by_batch: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))

    def record(self, plan: StepPlan, output: StepOutput) -> None:
        if plan.sequences and all(len(work.token_ids) == 1 for work in plan.sequences):
            self.by_batch[len(plan.sequences)].append(output.forward_seconds)


def step_caller(
    group: WorkerGroup, variant: str, log: StepLog
) -> Callable[[StepPlan], Awaitable[StepOutput]]:
    """`execute_async` for `rank_thread`; for `pool_thread` the rank's `execute` through
    `asyncio.to_thread` (a benchmark-only reach into the in-process rank)."""
    shipped = group.execute_async

    async def call(plan: StepPlan) -> StepOutput:
        if variant == "rank_thread":
            output = await shipped(plan)
        else:
            assert group._local is not None
            output = await asyncio.to_thread(group._local.execute, plan)
        log.record(plan, output)
        return output

    return call


async def replay(engine: AsyncEngine, args: argparse.Namespace) -> dict[str, Any]:
    jobs = random_workload(args.seed, args.num_requests, 128, 128)
    arrivals = random.Random(args.seed)
    ttfts: list[float] = []
    tpots: list[float] = []
    tokens = 0

    async def one(prompt: list[int], max_tokens: int) -> None:
        nonlocal tokens
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = GenerateRequest(RenderedPrompt(prompt, None), params)
        sent = time.perf_counter()
        first = last = None
        count = 0
        async for delta in engine.generate(request):
            new = sum(len(branch.token_ids) for branch in delta.branches)
            if new:
                last = time.perf_counter()
                first = first or last
                count += new
        assert first is not None and last is not None
        ttfts.append(first - sent)
        tpots.append((last - first) / max(1, count - 1))
        tokens += count

    began = time.perf_counter()
    tasks = []
    for job in jobs:
        assert isinstance(job.prompt, list)
        tasks.append(asyncio.create_task(one(job.prompt, job.max_tokens)))
        await asyncio.sleep(arrivals.expovariate(args.rate))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - began
    return {
        "output_tok_s": tokens / elapsed,
        "ttft_p50_s": statistics.median(ttfts),
        "tpot_p50_s": statistics.median(tpots),
        "elapsed_s": elapsed,
    }


async def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process: warm up, replay the load once, report."""
    engine = await AsyncEngine.create(served_app_args(()).engine_config())
    group = engine.core.workers
    log = StepLog()
    try:
        warmup = GenerateRequest(
            RenderedPrompt(list(range(1000, 1128)), None),
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        )
        async for _ in engine.generate(warmup):
            pass
        group.execute_async = step_caller(group, variant, log)  # type: ignore[method-assign]
        result = await replay(engine, args)
    finally:
        await engine.shutdown()
    result["decode_forward_s_by_batch"] = {str(k): v for k, v in log.by_batch.items()}
    return result


def run_in_subprocess(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.engine_replay", "--variant", variant]
    command += ["--num-requests", str(args.num_requests), "--rate", str(args.rate)]
    command += ["--seed", str(args.seed)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    for round_index in range(args.rounds):
        for variant in VARIANTS:
            result = run_in_subprocess(variant, args)
            rounds[variant].append(result)
            headline = {k: round(v, 4) for k, v in result.items() if isinstance(v, float)}
            print(f"round {round_index + 1} {variant}: {headline}", file=sys.stderr, flush=True)
    summary: dict[str, Any] = {}
    for variant in VARIANTS:
        runs = rounds[variant]
        by_batch: dict[int, list[float]] = defaultdict(list)
        for run_result in runs:
            for batch, times in run_result.pop("decode_forward_s_by_batch").items():
                by_batch[int(batch)].extend(times)
        summary[variant] = {
            key: statistics.median(run_result[key] for run_result in runs) for key in runs[0]
        } | {
            "decode_forward_ms_p50_by_batch": {
                batch: round(1e3 * statistics.median(times), 1)
                for batch, times in sorted(by_batch.items())
                if len(times) >= 5
            }
        }
    ours, before = summary["rank_thread"], summary["pool_thread"]
    summary["ratios"] = {
        "output_tok_s": ours["output_tok_s"] / before["output_tok_s"],
        "tpot_p50": ours["tpot_p50_s"] / before["tpot_p50_s"],
        "ttft_p50": ours["ttft_p50_s"] / before["ttft_p50_s"],
    }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", choices=VARIANTS, help="run one variant here (internal)")
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(asyncio.run(run_variant(args.variant, args))))
        return 0
    summary = run(args)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for variant in VARIANTS:
            print(variant, summary[variant])
        print("ratios (rank_thread / pool_thread)", summary["ratios"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
