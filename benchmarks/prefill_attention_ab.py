"""CPU prefill attention side by side: prefill chunks through the native kernel (each query row
as the decode of its position) against the torch path (one gather and one causal SDPA call per
chunk), both through `pagedserve_kernels.torch_cpu.paged_attention`.

`python -m benchmarks.prefill_attention_ab --json [--rounds 15] [--threads 2] [--dtype
bfloat16|float32] [--shapes 1x225+0,2x225+0,1x512+0,1x512+1536,1x512+3584]` builds, per shape
`<chunks>x<tokens>+<prior>`, one step of `chunks` prefill chunks of `tokens` query tokens, each
after `prior` cached tokens, shaped like SmolLM2-135M (9 query heads, 3 KV heads, head dim 64,
blocks of 16) with blocks shuffled over the pool, metadata prepared once as the model does.
`torch` is the same call with the native kernel refused (`attention_cpu.accepts` false).
Reported per shape: median ms per call of each, `torch_over_native` = median over rounds of the
ratio of the two, and the largest difference between their outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch

from pagedserve_kernels import attention_cpu, torch_cpu
from pagedserve_kernels.metadata import prepare_attention

BLOCK_SIZE = 16
KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64
SCALE = HEAD_DIM**-0.5


def parse_shape(text: str) -> tuple[int, int, int]:
    """`<chunks>x<tokens>+<prior>` -> (chunks, tokens, prior)."""
    chunks, rest = text.split("x")
    tokens, prior = rest.split("+")
    return int(chunks), int(tokens), int(prior)


def timed(call: Callable[[], object], repeats: int) -> float:
    """Mean ms of `repeats` calls after one warm-up."""
    call()
    began = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - began) / repeats * 1e3


def measure(shape: tuple[int, int, int], dtype: torch.dtype, rounds: int) -> dict[str, float]:
    chunks, tokens, prior = shape
    context = prior + tokens
    blocks = -(-context // BLOCK_SIZE)
    pool = chunks * blocks + 8
    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    v_cache = torch.randn(pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    order = torch.randperm(pool, generator=generator)[: chunks * blocks]
    tables = order.view(chunks, blocks).to(torch.int32)
    query = torch.randn(chunks * tokens, KV_HEADS * GROUP, HEAD_DIM, generator=generator).to(dtype)
    cu_query_lens = torch.arange(chunks + 1, dtype=torch.int32) * tokens
    context_lens = torch.full((chunks,), context, dtype=torch.int32)
    metadata = prepare_attention(
        cu_query_lens, context_lens, tables, num_blocks=pool, block_size=BLOCK_SIZE
    )
    outs = {name: torch.empty_like(query) for name in ("native", "torch")}

    def native() -> object:
        return torch_cpu.paged_attention(
            query, k_cache, v_cache, metadata, SCALE, None, outs["native"]
        )

    def plain() -> object:
        with mock.patch.object(torch_cpu.attention_cpu, "accepts", return_value=False):
            return torch_cpu.paged_attention(
                query, k_cache, v_cache, metadata, SCALE, None, outs["torch"]
            )

    repeats = max(1, 2000 // (chunks * tokens))
    times: dict[str, list[float]] = {"native": [], "torch": []}
    for _ in range(rounds):
        times["native"].append(timed(native, repeats))
        times["torch"].append(timed(plain, repeats))
    ratios = [t / n for t, n in zip(times["torch"], times["native"], strict=True)]
    difference = (outs["native"].float() - outs["torch"].float()).abs().max().item()
    return {
        "native_ms": round(statistics.median(times["native"]), 3),
        "torch_ms": round(statistics.median(times["torch"]), 3),
        "torch_over_native": round(statistics.median(ratios), 3),
        "max_abs_difference": difference,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--shapes", default="1x225+0,2x225+0,1x512+0,1x512+1536,1x512+3584")
    args = parser.parse_args(argv)
    if not attention_cpu.available():
        parser.error("the native attention kernel is not built or this CPU lacks AVX2")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    report = {
        "benchmark": "prefill_attention_ab",
        "threads": args.threads,
        "dtype": args.dtype,
        "isa": attention_cpu.best_isa(),
        "shapes": {
            text: measure(parse_shape(text), dtype, args.rounds) for text in args.shapes.split(",")
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for text, row in report["shapes"].items():
            print(
                f"{text:>12}: native {row['native_ms']:8.3f} ms  torch {row['torch_ms']:8.3f} ms"
                f"  torch/native {row['torch_over_native']:.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
