"""Device code for the paged KV cache: KV writes, paged attention, block copies and swaps.

Functions over tensors only: no requests, no block objects, no Ray. Every function validates its
input (``pagedserve_kernels.validation``) and raises ``ValueError`` before any launch. Dispatch:
Triton kernels for CUDA tensors, the plain-torch path (``pagedserve_kernels.torch_cpu``) for CPU
tensors. ``pagedserve_kernels.reference`` holds the simplest correct version of each function, the
tests' oracle.

A model attends through an ``AttentionStep``, one step's prepared metadata: ``PagedAttentionStep``
over the block tables, whatever the KV layout (a layout that keeps a sequence in one run of
blocks sends that run as its table). It writes KV through ``step.prepared`` and attends with
``step.attend(...)``.

Layout: one pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; layer l's K
cache is ``pool[l, 0]`` and its V cache ``pool[l, 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve_kernels import metadata as _metadata
from pagedserve_kernels import swap, torch_cpu, validation
from pagedserve_kernels.kv_pool import allocate_kv_pool
from pagedserve_kernels.metadata import PreparedAttention, prepare_attention

__all__ = [
    "AttentionStep",
    "PagedAttentionStep",
    "PreparedAttention",
    "allocate_kv_pool",
    "copy_blocks",
    "paged_attention",
    "prepare_attention",
    "swap_blocks",
    "write_kv",
]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor | None = None,
    *,
    metadata: PreparedAttention | None = None,
) -> None:
    """Write token i's K/V ``[H_kv, D]`` into slot ``slot_mapping[i]`` (block*block_size+offset).

    A slot of -1 is padding and skipped; every other cache entry is left bit-identical. Pass
    either ``slot_mapping`` (its values validated on every call) or ``metadata`` from
    ``prepare_attention(..., slot_mapping=...)`` (validated once per step; each call then checks
    only shapes, dtypes and devices).
    """
    validation.check_kv_operands(key, value, k_cache, v_cache)
    if (slot_mapping is None) == (metadata is None):
        raise ValueError("write_kv takes exactly one of slot_mapping and metadata")
    if metadata is not None:
        _metadata.check_prepared(metadata, key.shape[0], k_cache, writes=True)
        all_slots, slots, rows = metadata.slot_mapping, metadata.write_slots, metadata.write_rows
    else:
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        host = validation.check_slot_mapping(slot_mapping, key.shape[0], num_slots, k_cache.device)
        all_slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64)
        keep = host >= 0
        slots, rows = all_slots, None
        if not bool(keep.all()):
            slots, rows = host[keep].to(k_cache.device), torch.nonzero(keep).view(-1)
    if k_cache.is_cuda:
        from pagedserve_kernels import triton_cache_ops

        triton_cache_ops.write_kv(key, value, k_cache, v_cache, all_slots)
    else:
        assert slots is not None, "validated: prepared with a slot_mapping"
        torch_cpu.write_kv(key, value, k_cache, v_cache, slots, rows)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_query_lens: torch.Tensor | None = None,
    context_lens: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    metadata: PreparedAttention | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention for a packed mixed batch of prefill chunks and decodes.

    query ``[num_tokens, H_q, D]`` packed by sequence; ``cu_query_lens`` ``[num_seqs + 1]``;
    ``context_lens`` ``[num_seqs]`` counts cached tokens including this step's (already written);
    ``block_tables`` ``[num_seqs, max_blocks]``. Query token j of a sequence with q_len tokens is at
    position ``context_len - q_len + j`` and sees positions ``<=`` its own (and ``>`` its position
    minus ``sliding_window``). With ``softcap``, each scaled score ``s`` becomes
    ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2). Returns ``[num_tokens, H_q, D]``
    in query's dtype, fp32 accumulation.

    Instead of the three metadata tensors (validated on every call), pass ``metadata`` from
    ``prepare_attention`` (validated once per step and shared by every layer).
    """
    validation.check_attention_operands(
        query, k_cache, v_cache, scale, sliding_window, out, softcap
    )
    tensors = (cu_query_lens, context_lens, block_tables)
    if metadata is None:
        if any(t is None for t in tensors):
            raise ValueError(
                "paged_attention needs cu_query_lens, context_lens and block_tables, or metadata"
            )
        metadata = prepare_attention(
            cu_query_lens,  # type: ignore[arg-type]
            context_lens,  # type: ignore[arg-type]
            block_tables,  # type: ignore[arg-type]
            num_blocks=k_cache.shape[0],
            block_size=k_cache.shape[1],
            device=query.device,
        )
    elif any(t is not None for t in tensors):
        raise ValueError("paged_attention takes metadata or the metadata tensors, not both")
    _metadata.check_prepared(metadata, query.shape[0], k_cache)
    result = torch.empty_like(query) if out is None else out
    if query.is_cuda:
        from pagedserve_kernels import triton_attention

        num_kv_heads = k_cache.shape[2]
        batch = metadata.attention_batch(
            num_kv_heads, query.shape[1] // num_kv_heads, k_cache.shape[3]
        )
        return triton_attention.paged_attention(
            query, k_cache, v_cache, metadata.block_tables, batch, float(scale), sliding_window,
            result, softcap=None if softcap is None else float(softcap),
        )  # fmt: skip
    return torch_cpu.paged_attention(
        query,
        k_cache,
        v_cache,
        metadata,
        float(scale),
        sliding_window,
        result,
        None if softcap is None else float(softcap),
    )


class AttentionStep(Protocol):
    """One step's attention metadata, validated once and shared by every layer.

    ``prepared`` drives the KV writes (``write_kv(..., metadata=step.prepared)``); ``attend``
    computes causal attention of the step's packed queries over the caches, in the layout the
    step was prepared for. Returns ``[num_tokens, H_q, D]`` in the query's dtype.
    """

    @property
    def prepared(self) -> PreparedAttention: ...

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class PagedAttentionStep:
    """The paged layout's ``AttentionStep``: ``paged_attention`` over the block tables."""

    prepared: PreparedAttention

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return paged_attention(
            query,
            k_cache,
            v_cache,
            scale=scale,
            sliding_window=sliding_window,
            metadata=self.prepared,
            softcap=softcap,
        )


def copy_blocks(kv_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy-on-write: block ``src`` onto ``dst`` for each pair ``[P, 2]``, all layers, K and V."""
    validation.check_copy_blocks(kv_pool, pairs)
    if pairs.shape[0] == 0:
        return
    if kv_pool.is_cuda:
        from pagedserve_kernels import triton_cache_ops

        triton_cache_ops.copy_blocks(kv_pool, pairs)
    else:
        torch_cpu.copy_blocks(kv_pool, pairs)


def swap_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy block ``src`` of ``src_pool`` onto block ``dst`` of ``dst_pool``, all layers, K and V.

    Pools may live on different devices (CUDA <-> pinned CPU, or CPU <-> CPU).
    """
    validation.check_swap_blocks(src_pool, dst_pool, pairs)
    swap.swap_blocks(src_pool, dst_pool, pairs)
