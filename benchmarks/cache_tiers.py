"""Multi-turn chat with and without the CPU cache tier, side by side in one run.

`python -m benchmarks.cache_tiers --json [--quick]` prints one JSON object. Workload (seeded
random token ids, no tokenizer): `--conversations` conversations of `--turns` turns; each
conversation opens with its own `--context-tokens` document, each turn appends a
`--user-tokens` user message, and each request resends the whole history (every earlier prompt
and answer) plus the new message. Requests go turn by turn, conversation by conversation
(conversation 0 turn 1, conversation 1 turn 1, ..., conversation 0 turn 2, ...), one at a time,
so a conversation's blocks have left the small device pool before its next turn: with the tier
off they are gone and recomputed, with it on they are promoted back from the CPU tier.

Per mode: TTFT p50/p99 (arrival to first token, one request in flight, so it is that request's
prefill plus any copies), prompt tokens recomputed (tokens of a turn's history, already computed
by an earlier turn, that were not found cached: computed again), prefill tokens computed, hit
tokens per tier, blocks demoted/promoted. Top level: `ttft_p50_ratio_off_over_on` and
`recomputed_tokens_ratio_off_over_on`, plus the cost model's promotion crossover.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_mode(args: argparse.Namespace, cpu_cache: bool) -> dict[str, Any]:
    from cluster.engine.config import EngineConfig
    from cluster.engine.llm import LLM
    from cluster.engine.sampling_params import SamplingParams

    config = EngineConfig.build(
        {
            "model": {"model": args.model, "max_model_len": 2048},
            "cache": {
                "block_size": args.block_size,
                "num_device_blocks": args.device_blocks,
                "num_cpu_blocks": args.cpu_blocks,
                "cpu_cache": cpu_cache,
                "verify_swaps": args.verify_swaps,
                "watermark": 0.0,
            },
            "parallel": {"backend": "local"},
            "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 8},
        }
    )
    llm = LLM(config=config)
    vocab = llm.engine.model_info.vocab_size
    rng = random.Random(args.seed)
    histories = [
        [rng.randrange(vocab) for _ in range(args.context_tokens)]
        for _ in range(args.conversations)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))  # warm up
    before = llm.metrics()
    ttfts: list[float] = []
    recomputed = computed = 0
    answers: list[list[int]] = []
    for turn in range(args.turns):
        for conversation, history in enumerate(histories):
            previous = len(history) if turn else 0  # tokens an earlier turn computed
            history += [rng.randrange(vocab) for _ in range(args.user_tokens)]
            output = llm.generate([{"prompt_token_ids": list(history)}], params)[0]
            cached = output.num_cached_tokens or 0
            computed += len(history) - cached
            recomputed += max(0, previous - cached)
            metrics = output.metrics
            assert metrics is not None and metrics.first_token_time is not None
            ttfts.append(metrics.first_token_time - metrics.arrival_time)
            answer = output.outputs[0].token_ids
            history += answer
            if conversation == 0:
                answers.append(list(answer))
    after = llm.metrics()
    tier, tier_before = after.cache_tier, before.cache_tier
    result = {
        "cpu_cache": cpu_cache,
        "requests": len(ttfts),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p99_s": round(_quantile(ttfts, 0.99), 4),
        "ttft_mean_s": round(statistics.fmean(ttfts), 4),
        "prompt_tokens_recomputed": recomputed,
        "prefill_tokens_computed": computed,
        "hit_tokens_device": tier.device_hit_tokens - tier_before.device_hit_tokens,
        "hit_tokens_cpu": tier.cpu_hit_tokens - tier_before.cpu_hit_tokens,
        "demoted_blocks": tier.demoted_blocks - tier_before.demoted_blocks,
        "promoted_blocks": tier.promoted_blocks - tier_before.promoted_blocks,
        "refused_swap_ins": tier.refused_swap_ins,
        "swap_checksum_failures": after.swap_checksum_failures,
        "kv_bytes_to_cpu": after.kv_bytes_to_cpu - before.kv_bytes_to_cpu,
        "kv_bytes_to_device": after.kv_bytes_to_device - before.kv_bytes_to_device,
        "preemptions": after.preemptions - before.preemptions,
        "conversation_0_answers": answers,
    }
    model = llm.engine.scheduler.cost_model
    result["cost_model"] = {
        "kv_bytes_per_block": model.kv_bytes_per_block,
        "swap_bytes_per_second": model.swap_bytes_per_second,
        "learned_seconds_per_token": model.seconds_per_token,
        "promotion_crossover_seconds_per_token": model.promotion_crossover_seconds_per_token(
            args.block_size
        ),
    }
    llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a small run (seconds)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--context-tokens", type=int, default=384)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--answer-tokens", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device-blocks", type=int, default=48)
    parser.add_argument("--cpu-blocks", type=int, default=1280)
    parser.add_argument("--verify-swaps", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns = 8, 3
    began = time.perf_counter()
    on = run_mode(args, cpu_cache=True)
    off = run_mode(args, cpu_cache=False)
    same = on.pop("conversation_0_answers") == off.pop("conversation_0_answers")
    result = {
        "workload": {
            key: getattr(args, key)
            for key in (
                "model",
                "conversations",
                "turns",
                "context_tokens",
                "user_tokens",
                "answer_tokens",
                "block_size",
                "device_blocks",
                "cpu_blocks",
                "verify_swaps",
            )
        },
        "tier_on": on,
        "tier_off": off,
        "greedy_answers_identical": same,
        "ttft_p50_ratio_off_over_on": round(off["ttft_p50_s"] / on["ttft_p50_s"], 2),
        "ttft_p99_ratio_off_over_on": round(off["ttft_p99_s"] / on["ttft_p99_s"], 2),
        "recomputed_tokens_ratio_off_over_on": round(
            off["prompt_tokens_recomputed"] / max(on["prompt_tokens_recomputed"], 1), 2
        ),
        "seconds": round(time.perf_counter() - began, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
