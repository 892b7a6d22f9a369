"""Int8-activation products (`pagedserve_kernels.quant_dot_cpu`) against oneDNN's packed float32 and
bfloat16 products and the float32-arithmetic 4-bit kernel, side by side on SmolLM2-135M's shapes.

`python -m benchmarks.quant_dot --json [--rows 1,8,16,64,256,1024] [--rounds 9] [--threads 2]
[--isas all]` times, for each batch size and each of the layer products (fused QKV 960x576,
o 576x576, fused gate/up 3072x576, down 576x1536) and the LM head (49152x576, Q8_0), every
variant in turn, round after round, on the same weights:

- `f32_packed`, `bf16_packed`: `workers.dense_matmul.DenseMatmul` on prepacked float32 /
  bfloat16 weights (oneDNN);
- `q4_f32`: `pagedserve_kernels.q4_cpu` (4-bit codes, float32 arithmetic; rows <= 16, layers only);
- `int8_<isa>`: `pagedserve_kernels.quant_dot_cpu.quant_matmul` with each instruction set (by
  default only the fastest; `--isas all` for every one this CPU runs), float32 activations;
- with `--k-quants` (layers only), `int8_5bit` and `int8_6bit`: the fastest set on the panels'
  forms of Q5_K (5-bit codes) and Q6_K (6-bit codes, scales per 16) weights.

Run it under `ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI` to see oneDNN without native bfloat16 (its
bfloat16 product is then emulated, as on an Ice Lake). Weights are random Q4_1 / Q8_0 codes
(timing does not depend on values). Reported per shape and variant: the fastest round's ms
(the least disturbed by other load) and the median ms; and each variant's speed over
`f32_packed` (median of per-round ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from pagedserve_kernels import quant_dot_cpu
from pagedserve_kernels.q4_cpu import Q4Weight, q4_matmul
from pagedserve_kernels.q8_cpu import Q8Weight
from workers.dense_matmul import DenseMatmul

LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE = (49152, 576)
BLOCK = 32


def _q4(rows: int, cols: int) -> Q4Weight:
    return Q4Weight(
        torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8),
        (torch.rand(rows, cols // BLOCK) * 0.01).half().float(),
        (-torch.rand(rows, cols // BLOCK) * 0.08).half().float(),
    )


def _q8(rows: int, cols: int) -> Q8Weight:
    return Q8Weight(
        torch.randint(-127, 128, (rows, cols), dtype=torch.int8),
        (torch.rand(rows, cols // BLOCK) * 0.001).half().float(),
    )


def _byte_panels(rows: int, cols: int, bits: int) -> quant_dot_cpu.PanelWeight:
    groups = cols // quant_dot_cpu.SCALE_GROUP[bits]
    scales = torch.rand(rows, groups) * 0.001
    codes = torch.randint(0, 1 << bits, (rows, cols), dtype=torch.uint8)
    return quant_dot_cpu.PanelWeight.pack(codes, scales, -scales * (1 << (bits - 1)), bits)


def _variants(
    name: str, isas: list[str], rows: int, k_quants: bool = False
) -> dict[str, Callable[[torch.Tensor], object]]:
    out_features, in_features = HEAD_SHAPE if name == "lm_head" else LAYER_SHAPES[name]
    if name == "lm_head":
        q8 = _q8(out_features, in_features)
        weight, panels = q8.dequantize(), quant_dot_cpu.PanelWeight.from_q8(q8)
        q4 = None
    else:
        q4 = _q4(out_features, in_features)
        weight, panels = q4.dequantize(), quant_dot_cpu.PanelWeight.from_q4(q4)
    f32, bf16 = DenseMatmul(weight), DenseMatmul(weight.bfloat16())
    f32.pack()
    bf16.pack()
    variants: dict[str, Callable[[torch.Tensor], object]] = {
        "f32_packed": lambda x: f32(x),
        "bf16_packed": lambda x: bf16(x.bfloat16()),
    }
    if q4 is not None and rows <= 16:
        variants["q4_f32"] = lambda x: q4_matmul(x, q4)
    for isa in isas:
        variants[f"int8_{isa}"] = lambda x, isa=isa: quant_dot_cpu.quant_matmul(x, panels, isa)
    if k_quants and name != "lm_head":
        for bits in (5, 6):
            form = _byte_panels(out_features, in_features, bits)
            variants[f"int8_{bits}bit"] = lambda x, form=form: quant_dot_cpu.quant_matmul(x, form)
    return variants


def report(
    rounds: int, batches: list[int], isas: list[str], k_quants: bool = False
) -> dict[str, object]:
    results: dict[str, object] = {}
    for rows in batches:
        for name in [*LAYER_SHAPES, "lm_head"]:
            variants = _variants(name, isas, rows, k_quants)
            x = torch.randn(rows, (HEAD_SHAPE if name == "lm_head" else LAYER_SHAPES[name])[1])
            repeat = max(1, 64 // rows)  # short calls repeated so a round is not all timer
            for product in variants.values():
                product(x)  # warm-up
            times: dict[str, list[float]] = {variant: [] for variant in variants}
            for _ in range(rounds):
                for variant, product in variants.items():
                    began = time.perf_counter()
                    for _ in range(repeat):
                        product(x)
                    times[variant].append((time.perf_counter() - began) / repeat)
            row: dict[str, object] = {}
            for variant, spent in times.items():
                ratios = [f / t for f, t in zip(times["f32_packed"], spent, strict=True)]
                row[variant] = {
                    "best_ms": round(min(spent) * 1e3, 3),
                    "median_ms": round(statistics.median(spent) * 1e3, 3),
                    "speed_over_f32": round(statistics.median(ratios), 2),
                }
            results[f"rows_{rows}/{name}"] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--rows", default="1,8,16,64,256,1024", help="batch sizes")
    parser.add_argument("--isas", default="best", help="best | all | comma-separated names")
    parser.add_argument("--k-quants", action="store_true", help="add Q5_K / Q6_K panel forms")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    supported = list(quant_dot_cpu.supported_isas())
    isas = {"best": supported[:1], "all": supported}.get(args.isas, args.isas.split(","))
    batches = [int(rows) for rows in args.rows.split(",")]
    out = {
        "torch_threads": torch.get_num_threads(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "(unset)"),
        "results": report(args.rounds, batches, isas, args.k_quants),
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
