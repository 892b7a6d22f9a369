"""Side-by-side A/B of CPU decode-step variants of the SmolLM2 forward (bfloat16 unless
`--dtype`), in one process.

`python -m benchmarks.decode_ab --json [--batches 1,16,32] [--prompt-len 192] [--rounds 7]
[--threads 1] [--prefill] [--dtype bfloat16|float32] [--variants round2,unpacked,...]`
builds one in-process `WorkerGroup` per variant (the same weights and shapes), prefills each
batch, then times `--steps` decode steps per variant in turn, round after round (interleaved, so
both see the same machine load). Reported per batch: each variant's median step time and decode
tokens/s, and `ratio_over_<first>` = the median over rounds of (first's time / this one's time),
which is robust to load that changes between rounds.

Variants (round 3's changes switched off one by one on the shipped bfloat16 model):
- `shipped`: as loaded (LM head screened in bfloat16 and refined in float32, weights prepacked,
  decode attention by `_all_heads`).
- `sdpa_decode`: the same, decode attention by SDPA on the gathered buffers (round 2's kernel).
- `unpacked`: `sdpa_decode` with every `DenseMatmul`'s packed copy dropped (plain `F.linear`).
- `round2`: `unpacked` with the plain float32 LM head (screening off): round 2's forward.
The SDPA variants swap `kernels.torch_cpu._folds` for the duration of their own steps only.
With `--dtype float32` only `shipped` (packed) and `unpacked` differ: float32 has no screened head
and no folded attention.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch

from benchmarks.workers import OurRunner
from kernels import torch_cpu
from workers import WorkerConfig, WorkerGroup
from workers.dense_matmul import DenseMatmul


def _unpacked(group: WorkerGroup) -> None:
    """Drop every packed weight (the linear layers, the LM head's screen or, in float32, the
    head itself run `F.linear`)."""
    model = group._local.model  # a benchmark-only reach into the in-process rank
    for module in model.modules():
        matmul = getattr(module, "matmul", None)
        if isinstance(matmul, DenseMatmul):
            matmul.packed = None
    screen = getattr(model.lm_head, "screen", None)
    if screen is not None:
        screen.screen_matmul.packed = None
    model.lm_head.head_matmul.packed = None


def _round2(group: WorkerGroup) -> None:
    """Unpacked, and the LM head back to `F.linear` on its float32 weights."""
    _unpacked(group)
    group._local.model.lm_head.screen = None


VARIANTS: dict[str, Callable[[WorkerGroup], None]] = {
    "shipped": lambda group: None,
    "sdpa_decode": lambda group: None,
    "unpacked": _unpacked,
    "round2": _round2,
}
SDPA_DECODE = ("sdpa_decode", "unpacked", "round2")


@contextlib.contextmanager
def _decode_kernel(name: str) -> Iterator[None]:
    """Round 2's SDPA decode attention while variant `name`'s steps run (if it asks for it)."""
    if name not in SDPA_DECODE:
        yield
        return
    folds = torch_cpu._folds
    torch_cpu._folds = lambda cache_dtype, num_kv_heads, num_seqs: False  # benchmark-only
    try:
        yield
    finally:
        torch_cpu._folds = folds


def run(
    variants: list[str],
    batches: list[int],
    prompt_len: int,
    steps: int,
    rounds: int,
    prefill: bool = False,
    dtype: str = "bfloat16",
) -> dict[str, object]:
    """Per batch: median step ms and tokens/s per variant, and each one's speed ratio (with
    `prefill`, the same for a prefill of the whole batch each round)."""
    blocks_per_seq = -(-(prompt_len + steps + 1) // 16)  # rounds rewrite the same positions
    blocks = max(batches) * blocks_per_seq + 8
    groups = {}
    for name in variants:
        config = WorkerConfig(
            backend="local", dtype=dtype, num_device_blocks=blocks, num_cpu_blocks=1
        )
        groups[name] = WorkerGroup(config)
        VARIANTS[name](groups[name])
    results: dict[str, object] = {}
    try:
        for batch in batches:
            runners = {
                n: OurRunner(g, batch, prompt_len, blocks_per_seq) for n, g in groups.items()
            }
            for name, runner in runners.items():
                with _decode_kernel(name):
                    runner.prefill()
                    runner.decode(1)  # warm-up
            times: dict[str, list[float]] = {n: [] for n in variants}
            prefills: dict[str, list[float]] = {n: [] for n in variants}
            for _ in range(rounds):
                for name, runner in runners.items():
                    with _decode_kernel(name):
                        if prefill:
                            began = time.perf_counter()
                            runner.prefill()
                            prefills[name].append(time.perf_counter() - began)
                        began = time.perf_counter()
                        runner.decode(steps)
                        times[name].append((time.perf_counter() - began) / steps)
            first = variants[0]
            row: dict[str, object] = {}
            for name in variants:
                median = statistics.median(times[name])
                row[name] = {
                    "step_ms": round(median * 1e3, 2),
                    "tokens_per_s": round(batch / median, 1),
                }
                if name != first:
                    ratios = [a / b for a, b in zip(times[first], times[name], strict=True)]
                    row[name][f"ratio_over_{first}"] = round(statistics.median(ratios), 3)
                if prefill:
                    seconds = statistics.median(prefills[name])
                    row[name]["prefill_tokens_per_s"] = round(batch * prompt_len / seconds, 1)
                    if name != first:
                        ratios = [
                            a / b for a, b in zip(prefills[first], prefills[name], strict=True)
                        ]
                        ratio = round(statistics.median(ratios), 3)
                        row[name][f"prefill_ratio_over_{first}"] = ratio
            results[f"batch_{batch}"] = row
            print(f"batch {batch} done", file=sys.stderr, flush=True)
    finally:
        for group in groups.values():
            group.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--variants", default="round2,unpacked,sdpa_decode,shipped")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--prefill", action="store_true", help="also time a prefill per round")
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype (all variants)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    report = {
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "rounds": args.rounds,
        "results": run(
            variants,
            [int(b) for b in args.batches.split(",")],
            args.prompt_len,
            args.steps,
            args.rounds,
            args.prefill,
            args.dtype,
        ),
    }
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
