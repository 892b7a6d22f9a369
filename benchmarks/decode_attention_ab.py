"""CPU decode attention side by side: the native kernel (`pagedserve_kernels.attention_cpu`),
`_all_heads` (two bmm calls on gathered groups) and SDPA on gathered groups.

`python -m benchmarks.decode_attention_ab --json [--rounds 15] [--threads 1] [--seqs 1,4,16,32]
[--dtype bfloat16|float32] [--context 128,256]` builds, per batch size, one decode step shaped
like SmolLM2-135M (9 query heads, 3 KV heads, head dim 64, blocks of 16) with contexts drawn
uniformly from `--context`'s inclusive range (default 128..256) and
blocks shuffled over the pool, with 30 layers' caches (so the K/V reads are not all cache hits),
metadata prepared once per step as the model does. Each variant runs
`pagedserve_kernels.torch_cpu.paged_attention` over the 30 layers; `folded` turns the native kernel
off for its own calls (`attention_cpu.accepts` always false), `sdpa` also swaps `torch_cpu._folds`
to always-False; `native_<isa>` calls the kernel itself with each other instruction set this CPU
has (`attention_cpu.supported_isas()`; `native` is the fastest). Reported: median ms per layer of
each, `<variant>_over_native` = median over rounds of (its time / the native kernel's), and the
largest difference of each output from the native one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from pagedserve_kernels import attention_cpu, torch_cpu
from pagedserve_kernels.metadata import prepare_attention

LAYERS = 30
BLOCK_SIZE = 16
KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64


VARIANTS = ("native", "folded", "sdpa")


def _step(
    num_seqs: int, seed: int, dtype: torch.dtype, context: tuple[int, int]
) -> Callable[[str], torch.Tensor]:
    """A decode step over LAYERS caches with contexts drawn from the inclusive range `context`;
    the returned call runs it as one of `VARIANTS`."""
    rng = random.Random(seed)
    contexts = [rng.randint(*context) for _ in range(num_seqs)]
    blocks = [-(-c // BLOCK_SIZE) for c in contexts]
    num_blocks = sum(blocks) + 4
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = torch.full((num_seqs, max(blocks) + 1), -1, dtype=torch.int32)
    used = 0
    for seq, count in enumerate(blocks):
        tables[seq, :count] = order[used : used + count].to(torch.int32)
        used += count
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(LAYERS)]
    query = torch.randn(num_seqs, KV_HEADS * GROUP, HEAD_DIM).to(dtype)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32)
    lens = torch.tensor(contexts, dtype=torch.int32)
    folds, accepts = torch_cpu._folds, attention_cpu.accepts

    def run(variant: str) -> torch.Tensor:
        if variant.startswith("native_"):  # the kernel itself, with another instruction set
            prepared = prepare_attention(
                cu, lens, tables, num_blocks=num_blocks, block_size=BLOCK_SIZE
            )
            assert prepared.decode_rows is not None
            out = torch.empty_like(query)
            for k_cache, v_cache in caches:
                attention_cpu.decode_attention(
                    query, k_cache, v_cache, prepared.decode_rows, HEAD_DIM**-0.5, None, out,
                    isa=variant.removeprefix("native_"),
                )  # fmt: skip
            return out
        if variant != "native":
            attention_cpu.accepts = lambda query, k_cache, v_cache, out: False
        if variant == "sdpa":
            torch_cpu._folds = lambda cache_dtype, num_kv_heads, num_seqs: False
        try:
            prepared = prepare_attention(
                cu, lens, tables, num_blocks=num_blocks, block_size=BLOCK_SIZE
            )
            out = torch.empty_like(query)
            for k_cache, v_cache in caches:
                torch_cpu.paged_attention(
                    query, k_cache, v_cache, prepared, HEAD_DIM**-0.5, None, out
                )
            return out
        finally:
            torch_cpu._folds, attention_cpu.accepts = folds, accepts

    return run


def report(
    rounds: int, batches: list[int], dtype: torch.dtype, context: tuple[int, int]
) -> dict[str, object]:
    variants = VARIANTS + tuple(f"native_{isa}" for isa in attention_cpu.supported_isas()[1:])
    results: dict[str, object] = {}
    for num_seqs in batches:
        run = _step(num_seqs, seed=num_seqs, dtype=dtype, context=context)
        native = run("native").float()
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name in variants:
                began = time.perf_counter()
                run(name)
                times[name].append(time.perf_counter() - began)
        row: dict[str, float] = {}
        for name in variants:
            row[f"{name}_ms_per_layer"] = round(statistics.median(times[name]) * 1e3 / LAYERS, 3)
        for name in variants[1:]:
            ratios = [t / n for t, n in zip(times[name], times["native"], strict=True)]
            row[f"{name}_over_native"] = round(statistics.median(ratios), 3)
            row[f"{name}_max_abs_difference"] = float((run(name).float() - native).abs().max())
        results[f"seqs_{num_seqs}"] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seqs", default="1,4,16,32", help="batch sizes, comma-separated")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--context", default="128,256", help="LOW,HIGH: the inclusive range contexts are drawn from"
    )
    args = parser.parse_args()
    low, high = (int(bound) for bound in args.context.split(","))
    torch.set_num_threads(args.threads)
    batches = [int(seqs) for seqs in args.seqs.split(",")]
    results = report(args.rounds, batches, getattr(torch, args.dtype), (low, high))
    out = {
        "torch_threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "context": [low, high],
        "isas": list(attention_cpu.supported_isas()),
        "results": results,
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
