"""What sampling costs (greedy, penalized, drawn): rank 0's sampler alone, and the offline burst.

``python -m benchmarks.sampler --json`` runs, side by side in one process:

- the sampler alone (`workers.sampling.sample_rows`) on random logits of the default model's
  vocabulary, `--rows` rows each, with and without the repetition, frequency and presence
  penalties (every row penalized, `--history` earlier tokens per row, a quarter of them
  output), greedy, sampled (temperature 0.8, top-p 0.95) and OpenAI's default (temperature 1,
  top-p 1); medians of `--calls` calls, alternating;
- the offline burst (`--requests` natural-text chats from ``benchmarks.chat_corpus`` x
  `--max-tokens` tokens, ``ignore_eos``) through the shipped engine settings: greedy, greedy
  with every request penalized, sampled (temperature 0.8, top-p 0.95, seeded) and OpenAI's
  default (temperature 1, top-p 1, seeded), alternating `--pairs` times (skip with
  ``--sampler-only``).

It prints each figure and `..._over_plain` ratios: the sampler's ms per call and the burst's
output tok/s over plain greedy decoding's. Penalized and sampled tokens differ from greedy ones
by design, so the burst compares speed at equal token counts, not outputs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from workers.plan import SamplingSettings
from workers.sampling import SampleRequest, sample_rows

VOCAB = 49152
"""SmolLM2's vocabulary."""
PENALTIES: dict[str, float] = {
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.3,
}

SAMPLED: dict[str, float] = {"temperature": 0.8, "top_p": 0.95, "seed": 1}
"""The burst's sampled side: a chat client's usual settings, seeded."""
OPENAI_DEFAULT: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "seed": 1}
"""What a request that sets neither temperature nor top_p gets from OpenAI's API: sampling
from the whole distribution."""
DRAWS: dict[str, dict[str, float]] = {
    "greedy": {"temperature": 0.0, "top_p": 1.0},
    "sampled": {"temperature": 0.8, "top_p": 0.95},
    "default": {"temperature": 1.0, "top_p": 1.0},
}
"""The sampler's kinds of row: greedy, a chat client's usual settings, OpenAI's defaults."""


def sampler_requests(rows: int, history: int, penalized: bool, kind: str) -> list[SampleRequest]:
    rng = random.Random(rows * 1000 + history)
    extra = PENALTIES if penalized else {}
    settings = SamplingSettings(
        prompt_len=history * 3 // 4,
        **DRAWS[kind],  # type: ignore[arg-type]
        **extra,  # type: ignore[arg-type]
    )
    requests = []
    for row in range(rows):
        tokens = [rng.randrange(VOCAB) for _ in range(history)] if penalized else None
        requests.append(SampleRequest(settings, 1, 0, row, history=tokens))
    return requests


def time_sampler(rows: int, history: int, calls: int) -> dict[str, Any]:
    """Median ms per `sample_rows` call, plain and penalized, for each of `DRAWS`."""
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)) * 4
    result: dict[str, Any] = {"rows": rows, "history": history}
    for kind in DRAWS:
        sides = {
            "plain": sampler_requests(rows, history, False, kind),
            "penalized": sampler_requests(rows, history, True, kind),
        }
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(calls):
            for name, requests in sides.items():
                began = time.perf_counter()
                sample_rows(logits, requests, 0)
                times[name].append((time.perf_counter() - began) * 1e3)
        plain = statistics.median(times["plain"])
        penalized = statistics.median(times["penalized"])
        result[f"{kind}_plain_ms"] = round(plain, 3)
        result[f"{kind}_penalized_ms"] = round(penalized, 3)
        result[f"{kind}_penalized_over_plain"] = round(penalized / plain, 3)
    return result


def time_burst(requests: int, max_tokens: int, pairs: int) -> dict[str, Any]:
    """Output tok/s of the offline burst, plain and penalized, alternating."""
    from benchmarks.chat_corpus import chat_prompts
    from benchmarks.served_overhead import render_chats
    from cluster.serving.cli_serve import served_app_args
    from pagedserve import LLM, SamplingParams

    config = served_app_args([]).engine_config()
    prompts = [
        {"prompt_token_ids": ids} for ids in render_chats(config, chat_prompts(requests, seed=0))
    ]
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sides = {
        "plain": plain,
        "penalized": SamplingParams(**{**vars(plain), **PENALTIES}),
        "sampled": SamplingParams(**{**vars(plain), **SAMPLED}),
        "default": SamplingParams(**{**vars(plain), **OPENAI_DEFAULT}),
    }
    rates: dict[str, list[float]] = {name: [] for name in sides}
    with LLM(config=config) as llm:
        llm.generate(prompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)
        for _ in range(pairs):
            for name, params in sides.items():
                began = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - began
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                rates[name].append(tokens / elapsed)
        dtype = llm.engine.model_info.dtype
    result: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens, "dtype": dtype}
    for name, values in rates.items():
        result[f"{name}_output_tok_s"] = [round(v, 1) for v in values]
    for name in ("penalized", "sampled", "default"):
        result[f"{name}_over_plain"] = round(
            statistics.mean(rates[name]) / statistics.mean(rates["plain"]), 3
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--history", type=int, default=400)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--sampler-only", action="store_true")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "sampler": [time_sampler(rows, args.history, args.calls) for rows in args.rows],
        "penalties": PENALTIES,
    }
    if not args.sampler_only:
        report["burst"] = time_burst(args.requests, args.max_tokens, args.pairs)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
