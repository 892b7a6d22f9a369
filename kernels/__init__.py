"""Device code for the paged KV cache: KV writes, paged attention, block copies and swaps.

Functions over tensors only: no requests, no block objects, no Ray. Every function validates its
input (``kernels.validation``) and raises ``ValueError`` before any launch. Dispatch: Triton
kernels for CUDA tensors, the plain-torch path (``kernels.torch_cpu``) for CPU tensors.
``kernels.reference`` holds the simplest correct version of each function, the tests' oracle.

Layout: one pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; layer l's K
cache is ``pool[l, 0]`` and its V cache ``pool[l, 1]``.
"""

from __future__ import annotations

import torch

from kernels import swap, torch_cpu, validation
from kernels.reference import allocate_kv_pool

__all__ = [
    "allocate_kv_pool",
    "copy_blocks",
    "paged_attention",
    "swap_blocks",
    "write_kv",
]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token i's K/V ``[H_kv, D]`` into slot ``slot_mapping[i]`` (block*block_size+offset).

    A slot of -1 is padding and skipped; every other cache entry is left bit-identical.
    """
    validation.check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    if k_cache.is_cuda:
        from kernels import triton_cache_ops

        triton_cache_ops.write_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        torch_cpu.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention for a packed mixed batch of prefill chunks and decodes.

    query ``[num_tokens, H_q, D]`` packed by sequence; ``cu_query_lens`` ``[num_seqs + 1]``;
    ``context_lens`` ``[num_seqs]`` counts cached tokens including this step's (already written);
    ``block_tables`` ``[num_seqs, max_blocks]``. Query token j of a sequence with q_len tokens is at
    position ``context_len - q_len + j`` and sees positions ``<=`` its own (and ``>`` its position
    minus ``sliding_window``). Returns ``[num_tokens, H_q, D]`` in query's dtype, fp32 accumulation.
    """
    batch = validation.check_paged_attention(
        query,
        k_cache,
        v_cache,
        cu_query_lens,
        context_lens,
        block_tables,
        scale,
        sliding_window,
        out,
    )
    result = torch.empty_like(query) if out is None else out
    if query.is_cuda:
        from kernels import triton_attention

        return triton_attention.paged_attention(
            query, k_cache, v_cache, block_tables, batch, float(scale), sliding_window, result
        )
    return torch_cpu.paged_attention(
        query, k_cache, v_cache, block_tables, batch, float(scale), sliding_window, result
    )


def copy_blocks(kv_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy-on-write: block ``src`` onto ``dst`` for each pair ``[P, 2]``, all layers, K and V."""
    validation.check_copy_blocks(kv_pool, pairs)
    if pairs.shape[0] == 0:
        return
    if kv_pool.is_cuda:
        from kernels import triton_cache_ops

        triton_cache_ops.copy_blocks(kv_pool, pairs)
    else:
        torch_cpu.copy_blocks(kv_pool, pairs)


def swap_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy block ``src`` of ``src_pool`` onto block ``dst`` of ``dst_pool``, all layers, K and V.

    Pools may live on different devices (CUDA <-> pinned CPU, or CPU <-> CPU).
    """
    validation.check_swap_blocks(src_pool, dst_pool, pairs)
    swap.swap_blocks(src_pool, dst_pool, pairs)
