"""What scoring a prompt costs: prompt logprobs against a plain prefill, offline.

``python -m benchmarks.scoring --json`` renders `--requests` natural-text chats from
``benchmarks.chat_corpus`` (the token ids the engine would compute) and runs them through the
shipped serve settings in process (`LLM`), one token each, alternating `--pairs` times:

- plain: `max_tokens=1` (the prompt's KV and one draw: a prefill);
- scored: the same with `prompt_logprobs=1` (every prompt position through the LM head, each
  prompt token's log-probability and the best alternative: what an evaluation harness asks for
  with `echo`).

Both sides run with the prefix cache off for the plain side's sake too (a scored prompt never
reads it), so each computes every prompt token. It prints prompt tokens per second for each and
`scored_over_plain`, the scored rate's share of the plain one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args(argv)

    from benchmarks.chat_corpus import chat_prompts
    from benchmarks.served_overhead import render_chats
    from cluster.serving.cli_serve import served_app_args
    from pagedserve import LLM, SamplingParams

    config = served_app_args(["--no-enable-prefix-caching"]).engine_config()
    ids = render_chats(config, chat_prompts(args.requests, seed=0))
    prompts = [{"prompt_token_ids": prompt} for prompt in ids]
    prompt_tokens = sum(len(prompt) for prompt in ids)
    sides = {
        "plain": SamplingParams(temperature=0.0, max_tokens=1),
        "scored": SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
    }
    rates: dict[str, list[float]] = {name: [] for name in sides}
    with LLM(config=config) as llm:
        llm.generate(prompts[:4], sides["scored"], use_tqdm=False)  # warm both paths
        for _ in range(args.pairs):
            for name, params in sides.items():
                began = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                rates[name].append(prompt_tokens / (time.perf_counter() - began))
                if name == "scored":
                    assert all(o.prompt_logprobs is not None for o in outputs)
        dtype = llm.engine.model_info.dtype
    report: dict[str, Any] = {
        "requests": args.requests,
        "prompt_tokens": prompt_tokens,
        "dtype": dtype,
        **{f"{name}_prompt_tok_s": [round(v, 1) for v in values] for name, values in rates.items()},
        "scored_over_plain": round(
            statistics.mean(rates["scored"]) / statistics.mean(rates["plain"]), 3
        ),
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
