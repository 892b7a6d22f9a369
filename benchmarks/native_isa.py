"""The native CPU kernels with each instruction set this CPU has, beside the torch path they
replace, side by side in one run on SmolLM2-135M's decode shapes.

`python -m benchmarks.native_isa --json [--rounds 7] [--threads 1] [--rows 1,4,8,16]` times, per
batch of rows, each variant in turn, round after round (interleaved, so all see the same load):

- `q4_f32` / `q4_bf16`: the four products of every decoder layer (fused QKV 960x576, o 576x576,
  fused gate/up 3072x576, down 576x1536) over 30 layers' distinct weights (streamed from memory
  as in a forward pass), float32 / bfloat16 activations: `pagedserve_kernels.q4_cpu` with each
  instruction set (`native_<isa>`) against oneDNN on the prepacked weight (`packed`,
  `workers.dense_matmul`);
- `q8_head`: the LM head (49152x576, float32): `pagedserve_kernels.q8_cpu` per instruction set
  against the prepacked float32 head;
- `layer_ops_f32`: a layer's elementwise work 30 times (two residual adds with RMS norm over 576,
  rotary embeddings of 9 + 3 heads of 64 with the KV write, silu(gate) * up over 1536):
  `pagedserve_kernels.layer_ops_cpu` per instruction set against plain torch (the same steps as
  `workers.layer_ops.TorchLayerOps`).

Decode attention per instruction set is in `benchmarks.decode_attention_ab`. Reported: median ms
per variant and `<variant>_over_<first>` = the median over rounds of (the first variant's time /
this one's), which is robust to load that changes between rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve_kernels import layer_ops_cpu, q4_cpu, q8_cpu
from pagedserve_kernels.q4_cpu import Q4Weight
from pagedserve_kernels.q8_cpu import Q8Weight
from workers.dense_matmul import DenseMatmul

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
VOCAB, HIDDEN, INTERMEDIATE = 49152, 576, 1536
NUM_Q, NUM_KV, HEAD_DIM = 9, 3, 64

Variants = dict[str, Callable[[], object]]


def _packed(weight: torch.Tensor) -> DenseMatmul:
    matmul = DenseMatmul(weight)
    matmul.pack()
    return matmul


def q4_variants(rows: int, dtype: torch.dtype) -> Variants:
    """30 layers' products: oneDNN on packed weights, and the 4-bit kernel per instruction set."""
    layers = []
    for _ in range(LAYERS):
        for out_features, in_features in SHAPES:
            codes = Q4Weight(
                torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8),
                (torch.rand(out_features, in_features // 32) * 0.01).half().float(),
                (-torch.rand(out_features, in_features // 32) * 0.08).half().float(),
            )
            layers.append((codes, _packed(codes.dequantize().to(dtype))))
    inputs = {k: torch.randn(rows, k).to(dtype) for k in {s[1] for s in SHAPES}}

    def packed() -> None:
        for codes, matmul in layers:
            matmul(inputs[codes.shape[1]])

    def native(isa: str) -> Callable[[], None]:
        def run() -> None:
            for codes, _ in layers:
                q4_cpu.q4_matmul(inputs[codes.shape[1]], codes, isa=isa)

        return run

    return {"packed": packed} | {f"native_{isa}": native(isa) for isa in q4_cpu.supported_isas()}


def q8_variants(rows: int) -> Variants:
    """The LM head: the packed float32 product, and the 8-bit kernel per instruction set."""
    codes = torch.randint(-127, 128, (VOCAB, HIDDEN), dtype=torch.int8)
    scales = (torch.rand(VOCAB, HIDDEN // 32) * 0.001).half().float()
    weight = Q8Weight(codes, scales)
    head = _packed(weight.dequantize())
    x = torch.randn(rows, HIDDEN)
    variants: Variants = {"packed": lambda: head(x)}
    for isa in q8_cpu.supported_isas():
        variants[f"native_{isa}"] = lambda isa=isa: q8_cpu.q8_matmul(x, weight, isa=isa)
    return variants


def layer_ops_variants(rows: int) -> Variants:
    """A layer's norms, rotary embeddings with the KV write and silu, 30 times over."""
    residual = torch.randn(rows, HIDDEN)
    delta = torch.randn(rows, HIDDEN)
    weight = torch.rand(HIDDEN) + 0.5
    qkv = torch.randn(rows, (NUM_Q + 2 * NUM_KV) * HEAD_DIM)
    angles = torch.rand(rows, HEAD_DIM // 2) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    slots = torch.randperm(64 * 16)[:rows]
    k_cache = torch.zeros(64, 16, NUM_KV, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE)
    heads = (NUM_Q, NUM_KV, HEAD_DIM)

    def torch_ops() -> None:
        for _ in range(LAYERS):
            for _ in range(2):
                summed = residual + delta
                normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)
                _ = weight * normed
            q, k, v = qkv.view(rows, -1, HEAD_DIM).split([NUM_Q, NUM_KV, NUM_KV], dim=1)
            half = HEAD_DIM // 2
            rotated_q = (
                q * cos[:, None] + torch.cat((-q[..., half:], q[..., :half]), -1) * sin[:, None]
            )
            rotated_k = (
                k * cos[:, None] + torch.cat((-k[..., half:], k[..., :half]), -1) * sin[:, None]
            )
            k_cache.view(-1, NUM_KV, HEAD_DIM).index_copy_(0, slots, rotated_k)
            v_cache.view(-1, NUM_KV, HEAD_DIM).index_copy_(0, slots, v)
            _ = rotated_q.contiguous()
            gate, up = gate_up.chunk(2, dim=-1)
            _ = F.silu(gate) * up

    def native(isa: str) -> Callable[[], None]:
        def run() -> None:
            for _ in range(LAYERS):
                for _ in range(2):
                    layer_ops_cpu.add_rms_norm(residual, delta, weight, 1e-5, torch.float32, isa)
                layer_ops_cpu.rotary_write_kv(qkv, heads, cos, sin, slots, k_cache, v_cache, isa)
                layer_ops_cpu.silu_mul(gate_up, isa)

        return run

    isas = layer_ops_cpu.supported_isas()
    return {"torch": torch_ops} | {f"native_{isa}": native(isa) for isa in isas}


def time_side_by_side(variants: Variants, rounds: int) -> dict[str, float]:
    """Median ms of each variant and each one's speed over the first (median of round ratios)."""
    names = list(variants)
    for name in names:
        variants[name]()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            began = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - began)
    row: dict[str, float] = {}
    for name in names:
        row[f"{name}_ms"] = round(statistics.median(times[name]) * 1e3, 3)
        if name != names[0]:
            ratios = [b / t for b, t in zip(times[names[0]], times[name], strict=True)]
            row[f"{name}_over_{names[0]}"] = round(statistics.median(ratios), 3)
    return row


def report(rounds: int, batches: list[int]) -> dict[str, object]:
    results: dict[str, object] = {}
    for rows in batches:
        results[f"rows_{rows}"] = {
            "q4_f32": time_side_by_side(q4_variants(rows, torch.float32), rounds),
            "q4_bf16": time_side_by_side(q4_variants(rows, torch.bfloat16), rounds),
            "q8_head": time_side_by_side(q8_variants(rows), rounds),
            "layer_ops_f32": time_side_by_side(layer_ops_variants(rows), rounds),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rows", default="1,4,8,16", help="batch sizes, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(rows) for rows in args.rows.split(",")]
    out = {
        "torch_threads": torch.get_num_threads(),
        "isas": list(q4_cpu.supported_isas()),
        "results": report(args.rounds, batches),
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
