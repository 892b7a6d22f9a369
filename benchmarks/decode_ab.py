"""Side-by-side A/B of CPU decode-step variants of the SmolLM2 forward (bfloat16 unless
`--dtype`), in one process.

`python -m benchmarks.decode_ab --json [--batches 1,16,32] [--prompt-len 192] [--rounds 7]
[--threads 1] [--prefill] [--dtype bfloat16|float32] [--variants round2,unpacked,...]`
builds one in-process `WorkerGroup`, prefills each batch, then times `--steps` decode steps per
variant in turn, round after round (interleaved, so all see the same machine load), switching
the model to each variant for its own steps only (`_variant`). One group, so one rank thread and one
OpenMP team, as served: a group per variant would keep a team per rank thread alive, and with more
OpenMP threads than cores libgomp stops spinning at barriers for all of them, which slowed every
variant (up to 1.8x). Reported per batch: each variant's median step time and decode tokens/s, and
`ratio_over_<first>` = the median over rounds of (first's time / this one's time), which is robust
to load that changes between rounds.

Variants (the optimizations switched off one by one on the shipped bfloat16 model):
- `shipped`: as loaded (LM head screened in bfloat16 and refined in float32, weights prepacked;
  steps of up to 8 decodes (16 in float32) through the whole decoder stack in one native call,
  `pagedserve_kernels.decoder_stack_cpu`, every product on the 4-bit copy of a Q4_1 model's weights;
  the LM head of up to 4 rows on the 8-bit copy of its Q8_0 weights, `pagedserve_kernels.q8_cpu`).
- `per_operator`: without those two: per layer, decode attention by the native kernel
  `pagedserve_kernels.attention_cpu`, norms, rotary embeddings, KV writes and silu by
  `pagedserve_kernels.layer_ops_cpu`, products of at most 8 rows on the 4-bit copy, more on the
  packed one.
- `torch_layer_ops`: that with the layers' elementwise work in plain torch.
- `torch_attention`: that with decode attention on the torch path too (`_all_heads` on gathered
  groups).
- `dense`: that without the 4-bit copies (every linear on the packed weight).
- `sdpa_decode`: `dense` with decode attention by SDPA on the gathered buffers.
- `unpacked`: `sdpa_decode` with every `DenseMatmul`'s packed copy dropped (plain `F.linear`).
- `round2`: `unpacked` with the plain float32 LM head (screening off): the plainest forward.
With `--dtype float32` `sdpa_decode` equals `dense` and `round2` equals `unpacked`: float32 has no
screened head and no folded attention.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator

import torch

from benchmarks.workers import OurRunner, local_group
from pagedserve_kernels import attention_cpu, torch_cpu
from workers import WorkerGroup
from workers.dense_matmul import DenseMatmul
from workers.layer_ops import TorchLayerOps


def _matmuls(group: WorkerGroup) -> list[DenseMatmul]:
    """Every `DenseMatmul` of the in-process rank's model (a benchmark-only reach into it)."""
    model = group._local.model
    found = [
        m.matmul for m in model.modules() if isinstance(getattr(m, "matmul", None), DenseMatmul)
    ]
    found.append(model.lm_head.head_matmul)
    if model.lm_head.screen is not None:
        found.append(model.lm_head.screen.screen_matmul)
    return found


@contextlib.contextmanager
def _variant(group: WorkerGroup, name: str) -> Iterator[None]:
    """The model as variant `name` while its steps run, restored afterwards (see the module
    doc): the native decoder stack and the 8-bit LM head off (all but `shipped`), the native
    layer ops off (all but
    `shipped` and `per_operator`), the native decode attention off (all but those and
    `torch_layer_ops`), 4-bit copies dropped (all from `dense` on), packed
    weights dropped (`unpacked`, `round2`), the plain float32 LM head (`round2`), SDPA decode
    attention (`SDPA_DECODE`)."""
    model = group._local.model
    matmuls = _matmuls(group)
    saved = [(m.packed, m.q4) for m in matmuls]
    screen = model.lm_head.screen
    folds = torch_cpu._folds
    accepts = attention_cpu.accepts
    with_ops = [m for m in model.modules() if hasattr(m, "ops")]
    ops = [m.ops for m in with_ops]
    native_decode, q8_head = model.native_decode, model.lm_head.q8
    try:
        if name != "shipped":
            model.native_decode = None
            model.lm_head.q8 = None
        if name not in ("shipped", "per_operator"):
            for module in with_ops:
                module.ops = TorchLayerOps()
        if name not in ("shipped", "per_operator", "torch_layer_ops"):
            attention_cpu.accepts = lambda query, k_cache, v_cache, out: False
        for matmul in matmuls:
            if name in ("dense", *SDPA_DECODE):
                matmul.q4 = None
            if name in ("unpacked", "round2"):
                matmul.packed = None
        if name == "round2":
            model.lm_head.screen = None
        if name in SDPA_DECODE:
            torch_cpu._folds = lambda cache_dtype, num_kv_heads, num_seqs: False
        yield
    finally:
        for matmul, (packed, q4) in zip(matmuls, saved, strict=True):
            matmul.packed, matmul.q4 = packed, q4
        model.lm_head.screen = screen
        model.native_decode, model.lm_head.q8 = native_decode, q8_head
        torch_cpu._folds = folds
        attention_cpu.accepts = accepts
        for module, module_ops in zip(with_ops, ops, strict=True):
            module.ops = module_ops


SDPA_DECODE = ("sdpa_decode", "unpacked", "round2")
VARIANTS = ("shipped", "per_operator", "torch_layer_ops", "torch_attention", "dense", *SDPA_DECODE)


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
    group = local_group(blocks, dtype)
    results: dict[str, object] = {}
    try:
        for batch in batches:
            runner = OurRunner(group, batch, prompt_len, blocks_per_seq)
            runner.prefill()
            for name in variants:
                with _variant(group, name):
                    runner.decode(1)  # warm-up
            times: dict[str, list[float]] = {n: [] for n in variants}
            prefills: dict[str, list[float]] = {n: [] for n in variants}
            for _ in range(rounds):
                for name in variants:
                    with _variant(group, name):
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
