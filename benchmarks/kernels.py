"""Paged attention against the same data in contiguous tensors, side by side in one run.

``python -m benchmarks.kernels --json`` prints one JSON object.

* CPU (always): decode attention for a batch shaped like SmolLM2-135M (9 query heads, 3 KV
  heads, head dim 64), 32 sequences with contexts spread over 256..2048, through
  ``pagedserve_kernels.paged_attention`` (blocks shuffled across the pool) and through contiguous
  per-sequence K/V with ``scaled_dot_product_attention`` (one call per sequence, and one padded
  batched call with a mask). Reports ``paged_over_contiguous`` (paged time over the faster
  contiguous variant; target <= 1.25) and the KV bytes read per second; the paged path is timed
  as a validated call (``paged``) and as a layer's call with metadata prepared once per step
  (``paged_prepared``, ``pagedserve_kernels.prepare_attention``), the way the model calls it.
* CUDA (when present): the Triton decode kernel's achieved KV bandwidth as a fraction of the
  device's peak (spec from the memory clock and bus width when torch reports them, and measured
  copy bandwidth), and the prefill kernel's TFLOP/s, each beside SDPA on contiguous data.

Timings interleave the variants round by round and report medians, so a shared machine's noise
hits both sides alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import pagedserve_kernels


@dataclass(frozen=True)
class DecodeBatch:
    """One decode step's data in both layouts: a shuffled paged pool and per-sequence tensors."""

    query: torch.Tensor  # [num_seqs, H_q, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [1, H_kv, ctx, D], contiguous
    values: list[torch.Tensor]
    scale: float

    @property
    def kv_bytes(self) -> int:
        return sum(2 * k.numel() * k.element_size() for k in self.keys)


def make_decode_batch(
    context_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> DecodeBatch:
    """Random K/V written once into a shuffled pool; the contiguous copies hold the same values."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-ctx // block_size) for ctx in context_lens]
    num_blocks = sum(blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros((len(context_lens), max(blocks)), dtype=torch.int32)
    keys, values = [], []
    used = 0
    for seq, (ctx, count) in enumerate(zip(context_lens, blocks, strict=True)):
        ids = order[used : used + count]
        used += count
        tables[seq, :count] = ids.to(torch.int32)
        ids = ids.to(device)
        for cache, out in ((k_cache, keys), (v_cache, values)):
            dense = cache[ids].reshape(-1, num_kv_heads, head_dim)[:ctx]
            out.append(dense.transpose(0, 1).unsqueeze(0).contiguous())
    query = torch.randn((len(context_lens), num_q_heads, head_dim), generator=generator)
    cu = torch.arange(len(context_lens) + 1, dtype=torch.int32)
    return DecodeBatch(
        query=query.to(device=device, dtype=dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        cu_query_lens=cu.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        keys=keys,
        values=values,
        scale=head_dim**-0.5,
    )


def paged_decode(batch: DecodeBatch) -> torch.Tensor:
    return pagedserve_kernels.paged_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        cu_query_lens=batch.cu_query_lens,
        context_lens=batch.context_lens,
        block_tables=batch.block_tables,
        scale=batch.scale,
    )


def prepared_decode(
    batch: DecodeBatch, metadata: pagedserve_kernels.PreparedAttention
) -> torch.Tensor:
    """One layer's call as the model makes it: metadata validated and prepared once per step."""
    return pagedserve_kernels.paged_attention(
        batch.query, batch.k_cache, batch.v_cache, scale=batch.scale, metadata=metadata
    )


def prepare(batch: DecodeBatch) -> pagedserve_kernels.PreparedAttention:
    return pagedserve_kernels.prepare_attention(
        batch.cu_query_lens,
        batch.context_lens,
        batch.block_tables,
        num_blocks=batch.k_cache.shape[0],
        block_size=batch.k_cache.shape[1],
    )


def contiguous_decode_per_sequence(batch: DecodeBatch) -> torch.Tensor:
    """One SDPA call per sequence over its own contiguous K/V (no padding)."""
    outs = []
    for seq, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.query[seq].unsqueeze(0).unsqueeze(2)  # [1, H_q, 1, D]
        outs.append(
            F.scaled_dot_product_attention(q, k, v, scale=batch.scale, enable_gqa=True).view(
                1, -1, q.shape[-1]
            )
        )
    return torch.cat(outs)


def pad_batch(batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded ``[B, H_kv, max_ctx, D]`` K/V and a ``[B, 1, 1, max_ctx]`` mask of real keys."""
    max_ctx = max(k.shape[2] for k in batch.keys)
    k_pad = torch.cat([F.pad(k, (0, 0, 0, max_ctx - k.shape[2])) for k in batch.keys])
    v_pad = torch.cat([F.pad(v, (0, 0, 0, max_ctx - v.shape[2])) for v in batch.values])
    lens = torch.tensor([k.shape[2] for k in batch.keys], device=k_pad.device)
    mask = torch.arange(max_ctx, device=k_pad.device).unsqueeze(0) < lens.unsqueeze(1)
    return k_pad, v_pad, mask.view(len(batch.keys), 1, 1, max_ctx)


def contiguous_decode_padded(
    batch: DecodeBatch, padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """One batched SDPA call over K/V padded to the longest context, with a key mask."""
    k_pad, v_pad, mask = padded
    q = batch.query.unsqueeze(2)  # [B, H_q, 1, D]
    out = F.scaled_dot_product_attention(
        q, k_pad, v_pad, attn_mask=mask, scale=batch.scale, enable_gqa=True
    )
    return out.squeeze(2)


def time_side_by_side(
    variants: dict[str, Callable[[], object]], *, rounds: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Median seconds per call of each variant, measured in interleaved rounds after a warm-up."""
    for fn in variants.values():
        fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def spread_contexts(num_seqs: int, low: int, high: int) -> list[int]:
    """Context lengths evenly spread over [low, high], shuffled deterministically."""
    step = (high - low) / max(num_seqs - 1, 1)
    lens = [round(low + i * step) for i in range(num_seqs)]
    order = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(1)).tolist()
    return [lens[i] for i in order]


def cpu_decode_report(rounds: int) -> dict[str, object]:
    contexts = spread_contexts(32, 256, 2048)
    batch = make_decode_batch(
        contexts, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    padded = pad_batch(batch)
    metadata = prepare(batch)
    paged = paged_decode(batch)
    reference = contiguous_decode_per_sequence(batch)
    max_error = float((paged - reference).abs().max())
    max_error = max(max_error, float((prepared_decode(batch, metadata) - reference).abs().max()))
    times = time_side_by_side(
        {
            "paged": lambda: paged_decode(batch),
            "paged_prepared": lambda: prepared_decode(batch, metadata),
            "contiguous_per_sequence": lambda: contiguous_decode_per_sequence(batch),
            "contiguous_padded": lambda: contiguous_decode_padded(batch, padded),
        },
        rounds=rounds,
        sync=lambda: None,
    )
    best_contiguous = min(times["contiguous_per_sequence"], times["contiguous_padded"])
    return {
        "shape": {
            "num_seqs": 32,
            "context_range": [256, 2048],
            "num_q_heads": 9,
            "num_kv_heads": 3,
            "head_dim": 64,
            "block_size": 16,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
        },
        "seconds": times,
        "paged_over_contiguous": times["paged"] / best_contiguous,
        "paged_prepared_over_contiguous": times["paged_prepared"] / best_contiguous,
        "paged_over_contiguous_per_sequence": times["paged"] / times["contiguous_per_sequence"],
        "paged_over_contiguous_padded": times["paged"] / times["contiguous_padded"],
        "kv_bytes": batch.kv_bytes,
        "paged_kv_bytes_per_s": batch.kv_bytes / times["paged"],
        "contiguous_kv_bytes_per_s": batch.kv_bytes / best_contiguous,
        "max_abs_error_vs_contiguous": max_error,
        "target_paged_over_contiguous": 1.25,
    }


def peak_memory_bandwidth(device: torch.device) -> float | None:
    """Spec DRAM bandwidth in bytes/s (double data rate x bus width x memory clock), if reported."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2.0 * bus_bits / 8 * clock_khz * 1000


def measured_copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write), the practical ceiling."""
    from triton.testing import do_bench

    src = torch.empty(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def cuda_decode_figures(
    contexts: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int, peak: float | None,
    copy_peak: float,
) -> dict[str, object]:  # fmt: skip
    """Triton decode (kernel launch and public call) beside padded contiguous SDPA."""
    from triton.testing import do_bench

    from pagedserve_kernels import triton_attention, validation

    batch = make_decode_batch(
        contexts, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=16, dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    checked = validation.check_paged_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.cu_query_lens, batch.context_lens,
        batch.block_tables, batch.scale, None, None,
    )  # fmt: skip
    out = torch.empty_like(batch.query)

    def kernel_only() -> torch.Tensor:
        return triton_attention.paged_attention(
            batch.query, batch.k_cache, batch.v_cache, batch.block_tables, checked, batch.scale,
            None, out,
        )  # fmt: skip

    padded = pad_batch(batch)
    error = float(
        (kernel_only().float() - contiguous_decode_padded(batch, padded).float()).abs().max()
    )
    kernel_ms = do_bench(kernel_only)
    public_ms = do_bench(lambda: paged_decode(batch))
    sdpa_ms = do_bench(lambda: contiguous_decode_padded(batch, padded))
    bandwidth = batch.kv_bytes / (kernel_ms / 1e3)
    plan = triton_attention.plan_launch(
        checked, num_programs_target=2 * torch.cuda.get_device_properties(0).multi_processor_count
    )
    return {
        "num_seqs": len(contexts), "context_range": [min(contexts), max(contexts)],
        "heads_q_kv_dim": [num_q_heads, num_kv_heads, head_dim], "dtype": "bfloat16",
        "num_splits": plan.num_splits, "kv_bytes": batch.kv_bytes,
        "triton_kernel_ms": kernel_ms, "public_call_ms": public_ms, "sdpa_padded_ms": sdpa_ms,
        "triton_kv_bytes_per_s": bandwidth,
        "fraction_of_spec_peak": None if peak is None else bandwidth / peak,
        "fraction_of_measured_copy_bandwidth": bandwidth / copy_peak,
        "max_abs_error_vs_sdpa": error,
    }  # fmt: skip


def cuda_prefill_figures(num_seqs: int, length: int, num_q_heads: int, num_kv_heads: int,
                         head_dim: int) -> dict[str, object]:  # fmt: skip
    """Triton prefill (whole prompts, causal) TFLOP/s beside SDPA with is_causal on contiguous."""
    from triton.testing import do_bench

    from pagedserve_kernels import triton_attention, validation

    block_size = 16
    blocks = length // block_size
    generator = torch.Generator().manual_seed(0)
    pool_shape = (num_seqs * blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(pool_shape, generator=generator).to("cuda", torch.bfloat16)
    v_cache = torch.randn(pool_shape, generator=generator).to("cuda", torch.bfloat16)
    order = torch.randperm(num_seqs * blocks, generator=generator)
    tables = order.view(num_seqs, blocks).to("cuda", torch.int32)
    query = torch.randn((num_seqs * length, num_q_heads, head_dim), generator=generator)
    query = query.to("cuda", torch.bfloat16)
    cu = torch.arange(0, num_seqs * length + 1, length, dtype=torch.int32, device="cuda")
    ctx = torch.full((num_seqs,), length, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    checked = validation.check_paged_attention(
        query, k_cache, v_cache, cu, ctx, tables, scale, None, None
    )
    out = torch.empty_like(query)
    dense_k = k_cache[tables.long()].view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
    dense_v = v_cache[tables.long()].view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
    dense_q = query.view(num_seqs, length, num_q_heads, head_dim).transpose(1, 2)
    dense_k, dense_v, dense_q = dense_k.contiguous(), dense_v.contiguous(), dense_q.contiguous()

    def triton_call() -> torch.Tensor:
        return triton_attention.paged_attention(
            query, k_cache, v_cache, tables, checked, scale, None, out
        )

    def sdpa_call() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            dense_q, dense_k, dense_v, is_causal=True, scale=scale, enable_gqa=True
        )

    expected = sdpa_call().transpose(1, 2).reshape(query.shape)
    error = float((triton_call().float() - expected.float()).abs().max())
    flops = 4 * num_seqs * num_q_heads * head_dim * length * (length + 1) / 2  # causal half
    triton_ms, sdpa_ms = do_bench(triton_call), do_bench(sdpa_call)
    return {
        "num_seqs": num_seqs, "length": length,
        "heads_q_kv_dim": [num_q_heads, num_kv_heads, head_dim], "dtype": "bfloat16",
        "triton_ms": triton_ms, "sdpa_ms": sdpa_ms,
        "triton_tflops": flops / (triton_ms / 1e3) / 1e12,
        "sdpa_tflops": flops / (sdpa_ms / 1e3) / 1e12,
        "triton_over_sdpa_time": triton_ms / sdpa_ms,
        "max_abs_error_vs_sdpa": error,
    }  # fmt: skip


def cuda_report() -> dict[str, object]:
    device = torch.device("cuda")
    peak = peak_memory_bandwidth(device)
    copy_peak = measured_copy_bandwidth(device)
    return {
        "device": torch.cuda.get_device_name(device),
        "spec_peak_bytes_per_s": peak,
        "measured_copy_bytes_per_s": copy_peak,
        "decode_smollm2_shape": cuda_decode_figures(
            spread_contexts(32, 256, 2048), 9, 3, 64, peak, copy_peak
        ),
        "decode_long_contexts": cuda_decode_figures([8192] * 64, 32, 8, 128, peak, copy_peak),
        "decode_few_very_long": cuda_decode_figures([65536] * 4, 32, 8, 128, peak, copy_peak),
        "prefill": cuda_prefill_figures(4, 4096, 32, 8, 128),
        "target_decode_fraction_of_peak_long_contexts": 0.7,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
    parser.add_argument("--skip-cuda", action="store_true", help="CPU figures only")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared, oversubscribed machine, intra-op thread "
        "hand-offs dominate small ops and swamp the comparison)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report: dict[str, object] = {"cpu_decode": cpu_decode_report(args.rounds)}
    if torch.cuda.is_available() and not args.skip_cuda:
        report["cuda"] = cuda_report()
    else:
        report["cuda"] = None
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for section, figures in report.items():
            print(section, figures)


if __name__ == "__main__":
    main()
