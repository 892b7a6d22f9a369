"""What priority scheduling buys interactive requests beside a batch flood, and what the flood
pays for it, in process.

``python -m benchmarks.priority --json`` runs the shipped model (the `pagedserve serve` engine
settings, `--max-num-seqs` seats) on an `AsyncEngine` twice, once per `scheduling_policy`:

- the flood: `--flood` short one-question chats at priority 10, all queued at once, each
  `--flood-tokens` tokens (EOS ignored), far more than the seats;
- the interactive class: `--interactive` other such chats at priority 0, one every `--every-s`
  seconds from `--every-s` after the flood was queued, `--interactive-tokens` tokens each.

Short prompts keep the run to minutes on a shared 2-core CPU; the decode seats, not the
prefill, are what the two classes compete for.

Under `fcfs` the interactive requests carry priority 0 as well (what fcfs takes), so they queue
behind every flood request that arrived before them. It prints, per policy, the interactive
class's time to first token (p50, p99, max, seconds, measured from the request's arrival to its
first token, as the engine's metrics time it), the flood's output tokens per second over its
whole run, every output token per second until the last request ended, and
`flood_throughput_lost`: how much of the fcfs flood rate (the mean over `--rounds` alternating
runs of each policy) priority scheduling costs (negative: none). The interactive tokens that
run inside the flood under `priority` (after it under `fcfs`) are part of that cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

FLOOD_PRIORITY = 10
INTERACTIVE_PRIORITY = 0


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile (0..100) by linear interpolation between order statistics."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def run_policy(
    policy: str, args: argparse.Namespace, flood: list[list[int]], interactive: list[list[int]]
) -> dict[str, Any]:
    """One policy's run: the interactive TTFTs and the flood's token rate."""
    from cluster.engine.async_engine import AsyncEngine
    from cluster.engine.generate_request import GenerateRequest
    from cluster.serving.cli_serve import served_app_args
    from pagedserve import SamplingParams

    flags = ["--max-num-seqs", str(args.max_num_seqs), "--scheduling-policy", policy]
    config = served_app_args(flags).engine_config()
    engine = await AsyncEngine.create(config)
    builder = engine.request_builder

    def request(ids: list[int], tokens: int, priority: int) -> GenerateRequest:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        rank = priority if policy == "priority" else 0
        return builder.build({"prompt_token_ids": ids}, params, priority=rank)

    async def drain(generate: GenerateRequest) -> tuple[int, float | None]:
        """Output tokens and the engine's TTFT (arrival to first token) of one request."""
        tokens, ttft = 0, None
        async for delta in engine.generate(generate):
            tokens += sum(len(branch.token_ids) for branch in delta.branches)
            if delta.finished:
                ttft = delta.metrics.ttft if delta.metrics is not None else None
        return tokens, ttft

    try:
        await drain(request(flood[0], 4, FLOOD_PRIORITY))  # warm the model's paths
        began = time.perf_counter()
        flood_tasks = [
            asyncio.create_task(drain(request(ids, args.flood_tokens, FLOOD_PRIORITY)))
            for ids in flood
        ]
        interactive_tasks = []
        for ids in interactive:
            await asyncio.sleep(args.every_s)
            interactive_tasks.append(
                asyncio.create_task(
                    drain(request(ids, args.interactive_tokens, INTERACTIVE_PRIORITY))
                )
            )
        flood_results = await asyncio.gather(*flood_tasks)
        flood_seconds = time.perf_counter() - began
        interactive_results = await asyncio.gather(*interactive_tasks)
        all_seconds = time.perf_counter() - began
        preemptions = engine.metrics().preemptions
    finally:
        await engine.shutdown()
    ttfts = [ttft for _, ttft in interactive_results if ttft is not None]
    assert len(ttfts) == len(interactive), "every interactive request reports its TTFT"
    return {
        "interactive_ttft_p50_s": round(statistics.median(ttfts), 3),
        "interactive_ttft_p99_s": round(percentile(ttfts, 99), 3),
        "interactive_ttft_max_s": round(max(ttfts), 3),
        "flood_tok_s": round(sum(tokens for tokens, _ in flood_results) / flood_seconds, 2),
        "flood_seconds": round(flood_seconds, 2),
        "all_tok_s": round(
            sum(tokens for tokens, _ in flood_results + interactive_results) / all_seconds, 2
        ),
        "preemptions": preemptions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--flood", type=int, default=32)
    parser.add_argument("--flood-tokens", type=int, default=32)
    parser.add_argument("--interactive", type=int, default=6)
    parser.add_argument("--interactive-tokens", type=int, default=8)
    parser.add_argument("--every-s", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)

    from benchmarks.served_overhead import render_chats
    from cluster.serving.cli_serve import served_app_args

    config = served_app_args([]).engine_config()
    chats = [
        [{"role": "user", "content": f"Question {i}: name a colour and say why you like it."}]
        for i in range(args.flood + args.interactive)
    ]
    ids = render_chats(config, chats)
    flood, interactive = ids[: args.flood], ids[args.flood :]
    runs: dict[str, list[dict[str, Any]]] = {"fcfs": [], "priority": []}
    for _ in range(args.rounds):  # alternating, so a noisy machine hits both alike
        for policy, results in runs.items():
            results.append(asyncio.run(run_policy(policy, args, flood, interactive)))
    fcfs_rate, priority_rate = (
        statistics.mean(run["flood_tok_s"] for run in runs[policy])
        for policy in ("fcfs", "priority")
    )
    report: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "flood": {"requests": args.flood, "tokens_each": args.flood_tokens},
        "interactive": {
            "requests": args.interactive,
            "tokens_each": args.interactive_tokens,
            "every_s": args.every_s,
        },
        **runs,
        "interactive_ttft_p50_s": {
            policy: round(statistics.median(run["interactive_ttft_p50_s"] for run in results), 3)
            for policy, results in runs.items()
        },
        "flood_throughput_lost": round(1 - priority_rate / fcfs_rate, 3),
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
