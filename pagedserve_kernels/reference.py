"""The simplest correct version of every kernel: the oracle the fast paths are tested against.

Same signatures and semantics as the public API in ``pagedserve_kernels/__init__.py``. Loops over
tokens, sequences and pairs on purpose: clarity over speed. Attention is computed in fp32 and
returned in the query's dtype.
"""

from __future__ import annotations

import torch

from pagedserve_kernels import validation


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Token i goes to block ``slot // block_size``, offset ``slot % block_size``; -1 is skipped."""
    validation.check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[token]
        v_cache[slot // block_size, slot % block_size] = value[token]


def gather_context(
    cache: torch.Tensor, block_table_row: torch.Tensor, context_len: int
) -> torch.Tensor:
    """The first ``context_len`` tokens of one sequence's cache, ``[context_len, H_kv, D]``."""
    block_size = cache.shape[1]
    rows = []
    for position in range(context_len):
        block = int(block_table_row[position // block_size])
        rows.append(cache[block, position % block_size])
    if not rows:
        return cache.new_zeros((0, cache.shape[2], cache.shape[3]))
    return torch.stack(rows)


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
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its paged context.

    Query token j of a sequence with ``q_len`` tokens sits at position ``context_len - q_len + j``
    and sees keys at positions ``p`` with ``p <= position`` (and ``p > position - sliding_window``
    when a window is given). Query head h reads KV head ``h // (H_q // H_kv)``. With ``softcap``
    each scaled score ``s`` is replaced by ``softcap * tanh(s / softcap)`` before the softmax.
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
        softcap,
    )
    result = torch.empty_like(query) if out is None else out
    tables = block_tables.to("cpu")
    for seq in range(batch.num_seqs):
        start, q_len = batch.query_starts[seq], batch.query_lens[seq]
        context_len = batch.context_lens[seq]
        if q_len == 0:
            continue
        keys = gather_context(k_cache, tables[seq], context_len).float()
        values = gather_context(v_cache, tables[seq], context_len).float()
        keys = keys.repeat_interleave(batch.group_size, dim=1)  # [ctx, H_q, D]
        values = values.repeat_interleave(batch.group_size, dim=1)
        for j in range(q_len):
            position = context_len - q_len + j
            lowest = 0 if sliding_window is None else max(0, position - sliding_window + 1)
            q = query[start + j].float()  # [H_q, D]
            k = keys[lowest : position + 1]  # [n, H_q, D]
            v = values[lowest : position + 1]
            scores = torch.einsum("hd,nhd->hn", q, k) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            weights = torch.softmax(scores, dim=-1)
            result[start + j] = torch.einsum("hn,nhd->hd", weights, v).to(query.dtype)
    return result


def copy_blocks(kv_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy block ``src`` onto block ``dst`` for every pair, in every layer, K and V."""
    validation.check_copy_blocks(kv_pool, pairs)
    for src, dst in pairs.tolist():
        kv_pool[:, :, dst] = kv_pool[:, :, src]


def swap_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy block ``src`` of ``src_pool`` onto block ``dst`` of ``dst_pool``, all layers, K, V."""
    validation.check_swap_blocks(src_pool, dst_pool, pairs)
    for src, dst in pairs.tolist():
        dst_pool[:, :, dst].copy_(src_pool[:, :, src])
