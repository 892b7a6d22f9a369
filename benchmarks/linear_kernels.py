"""The linear-layer kernels torch offers on this CPU, side by side on SmolLM2-135M's shapes.

`python -m benchmarks.linear_kernels --json [--rounds 8] [--threads 1] [--rows 1,16,32]` times,
for batches of 1, 16 and 32 rows (by default), the four products of every decoder layer (fused
QKV 960x576, o 576x576, fused gate/up 3072x576, down 576x1536) over 30 layers' distinct weights
(so weights stream from memory as in a forward pass, not from cache), each variant in turn,
round after round:

- `bf16`: `F.linear` on bfloat16 weights;
- `bf16_packed`: the same weights prepacked for oneDNN (`workers.dense_matmul`);
- `int8_weight`: `aten._weight_int8pack_mm` (int8 weights, per-row scales, bfloat16 activations);
- `int4_weight`: `aten._weight_int4pack_mm_for_cpu` (int4 weights, groups of 32, bfloat16);
- `int8_dynamic`: fbgemm's `quantized.linear_dynamic` (int8 weights per row, float32 activations
  quantized per call to 8 bits): fast, but its per-tensor activation quantization fails the
  bfloat16 greedy bound on SmolLM2 (68 of 240 greedy steps flipped), so it is timed only;
- `q4_cpu`: this project's kernel (`pagedserve_kernels.q4_cpu`) on GGUF Q4_1 codes with float32
  scales and minimums, bfloat16 activations, over the exact float32 weights;
- `f32_packed` and `q4_cpu_f32`: the float32 mode's packed product and the same kernel with
  float32 activations.

Weights are random (the timing does not depend on values). Reported: median ms per forward's
worth of layer products per variant, and each one's speed over `bf16` (median of per-round
ratios).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve_kernels.q4_cpu import Q4Weight, available, q4_matmul
from workers.dense_matmul import DenseMatmul

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
GROUP = 32


def _layer_products(
    out_features: int, in_features: int
) -> dict[str, Callable[[torch.Tensor], object]]:
    weight = torch.randn(out_features, in_features) * 0.05
    plain = weight.bfloat16()
    packed = DenseMatmul(plain)
    packed.pack()
    packed_f32 = DenseMatmul(weight)
    packed_f32.pack()
    codes = Q4Weight(
        torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8),
        (torch.rand(out_features, in_features // GROUP) * 0.01).half().float(),
        (-torch.rand(out_features, in_features // GROUP) * 0.08).half().float(),
    )
    int8 = torch.randint(-127, 127, (out_features, in_features), dtype=torch.int8)
    scales = torch.rand(out_features).bfloat16()
    nibbles = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
    scale_zero = torch.rand(in_features // GROUP, out_features, 2).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor creation is deprecated upstream
        quantized = torch.quantize_per_channel(
            weight,
            weight.abs().amax(1) / 127,
            torch.zeros(out_features, dtype=torch.long),
            0,
            torch.qint8,
        )
        dynamic = torch.ops.quantized.linear_prepack(quantized, None)
    products: dict[str, Callable[[torch.Tensor], object]] = {
        "bf16": lambda x: F.linear(x, plain),
        "bf16_packed": lambda x: packed(x),
        "int8_weight": lambda x: torch.ops.aten._weight_int8pack_mm(x, int8, scales),
        "int4_weight": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, int4, GROUP, scale_zero
        ),
        "int8_dynamic": lambda x: torch.ops.quantized.linear_dynamic(x.float(), dynamic, True),
        "f32_packed": lambda x: packed_f32(x.float()),
    }
    if available():  # the native kernel is built and this CPU runs it
        products["q4_cpu"] = lambda x: q4_matmul(x, codes)
        products["q4_cpu_f32"] = lambda x: q4_matmul(x.float(), codes)
    return products


def report(rounds: int, batches: list[int]) -> dict[str, object]:
    layers = [[(shape, _layer_products(*shape)) for shape in SHAPES] for _ in range(LAYERS)]
    names = list(layers[0][0][1])
    results: dict[str, object] = {}
    for rows in batches:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in {s[1] for s in SHAPES}}

        def forward(name: str, inputs: dict[int, torch.Tensor] = inputs) -> None:
            for layer in layers:
                for (_, in_features), products in layer:
                    products[name](inputs[in_features])

        for name in names:
            forward(name)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(rounds):
            for name in names:
                began = time.perf_counter()
                forward(name)
                times[name].append(time.perf_counter() - began)
        row: dict[str, object] = {}
        for name in names:
            ratios = [b / t for b, t in zip(times["bf16"], times[name], strict=True)]
            row[name] = {
                "ms": round(statistics.median(times[name]) * 1e3, 2),
                "speed_over_bf16": round(statistics.median(ratios), 3),
            }
        results[f"rows_{rows}"] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rows", default="1,16,32", help="batch sizes, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(rows) for rows in args.rows.split(",")]
    out = {"torch_threads": torch.get_num_threads(), "results": report(args.rounds, batches)}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
