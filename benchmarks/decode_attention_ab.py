"""CPU bfloat16 decode attention: `_all_heads` (two bmm calls) against SDPA, side by side.

`python -m benchmarks.decode_attention_ab --json [--rounds 15] [--threads 1]` builds, per batch
size (1, 4, 16, 32 sequences), one decode step shaped like SmolLM2-135M (9 query heads, 3 KV
heads, head dim 64, blocks of 16, bfloat16) with contexts drawn from 128..256 and blocks shuffled
over the pool, with 30 layers' caches (so the K/V reads are not all cache hits), metadata
prepared once per step as the model does. Each variant runs `kernels.torch_cpu.paged_attention`
over the 30 layers; `sdpa` swaps `torch_cpu._folds` to always-False for its own calls. Reported:
median ms per layer of each and `ratio` = median over rounds of (SDPA time / folded time), plus
the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from kernels import torch_cpu
from kernels.metadata import prepare_attention

LAYERS = 30
BLOCK_SIZE = 16
KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64


def _step(num_seqs: int, seed: int) -> Callable[[bool], torch.Tensor]:
    """A decode step over LAYERS caches; the returned call runs it folded or through SDPA."""
    rng = random.Random(seed)
    contexts = [rng.randint(128, 256) for _ in range(num_seqs)]
    blocks = [-(-c // BLOCK_SIZE) for c in contexts]
    num_blocks = sum(blocks) + 4
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = torch.full((num_seqs, max(blocks) + 1), -1, dtype=torch.int32)
    used = 0
    for seq, count in enumerate(blocks):
        tables[seq, :count] = order[used : used + count].to(torch.int32)
        used += count
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(LAYERS)]
    query = torch.randn(num_seqs, KV_HEADS * GROUP, HEAD_DIM).bfloat16()
    cu = torch.arange(num_seqs + 1, dtype=torch.int32)
    lens = torch.tensor(contexts, dtype=torch.int32)
    folds = torch_cpu._folds

    def run(folded: bool) -> torch.Tensor:
        if not folded:
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
            torch_cpu._folds = folds

    return run


def report(rounds: int) -> dict[str, object]:
    results: dict[str, object] = {}
    for num_seqs in (1, 4, 16, 32):
        run = _step(num_seqs, seed=num_seqs)
        difference = float((run(True).float() - run(False).float()).abs().max())
        times: dict[str, list[float]] = {"folded": [], "sdpa": []}
        for _ in range(rounds):
            for name in times:
                began = time.perf_counter()
                run(name == "folded")
                times[name].append(time.perf_counter() - began)
        ratios = [s / f for s, f in zip(times["sdpa"], times["folded"], strict=True)]
        results[f"seqs_{num_seqs}"] = {
            "folded_ms_per_layer": round(statistics.median(times["folded"]) * 1e3 / LAYERS, 3),
            "sdpa_ms_per_layer": round(statistics.median(times["sdpa"]) * 1e3 / LAYERS, 3),
            "ratio_sdpa_over_folded": round(statistics.median(ratios), 3),
            "max_abs_difference": difference,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = {"torch_threads": torch.get_num_threads(), "results": report(args.rounds)}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
