"""The fast plain-torch path, used for CPU tensors.

Attention loops over sequences (never over tokens): one ``index_select`` per cache gathers a
sequence's blocks through its block table into a buffer reused across sequences (so it stays in the
CPU cache), then a decode token attends with two batched matmuls and a prefill chunk with one
``scaled_dot_product_attention`` call. GQA never repeats a K/V head in memory: the query heads of a
KV head are the rows of one matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.validation import AttentionBatch


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the tokens with a slot >= 0 into the flattened ``[num_slots, H_kv, D]`` caches."""
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value)


def _visible_mask(
    q_len: int, first_key: int, context_len: int, sliding_window: int | None
) -> torch.Tensor | None:
    """Boolean ``[q_len, keys]`` mask of the keys ``first_key..context_len-1`` each query sees.

    Returns None for a single query: ``first_key`` already starts its window, so it sees all keys.
    """
    if q_len == 1:
        return None
    first_query = context_len - q_len
    positions = torch.arange(first_query, context_len).unsqueeze(1)
    keys = torch.arange(first_key, context_len).unsqueeze(0)
    visible = keys <= positions
    if sliding_window is not None:
        visible &= keys > positions - sliding_window
    return visible


def _decode_one(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token over its keys: ``query [H_kv, group, D]``, keys/values ``[n, H_kv, D]``.

    Two batched matmuls over the gathered (cache-resident) buffer in fp32; no mask is needed because
    the caller passes exactly the keys the token sees. Returns ``[H_kv, group, D]`` in fp32.
    """
    if keys.dtype != torch.float32:
        keys, values = keys.float(), values.float()
    scores = torch.bmm(query.float(), keys.permute(1, 2, 0))
    scores.mul_(scale)
    weights = torch.softmax(scores, dim=-1)
    return torch.bmm(weights, values.transpose(0, 1))


def _prefill_one(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    first_key: int,
    context_len: int,
    sliding_window: int | None,
) -> torch.Tensor:
    """Several query tokens ``[q_len, H_kv, group, D]`` over keys/values ``[n, H_kv, D]``.

    GQA is folded into the rows (``[H_kv, group * q_len, D]``) so no K/V head is repeated.
    Returns ``[q_len, H_kv, group, D]`` in the query's dtype.
    """
    q_len, num_kv_heads, group, head_dim = query.shape
    folded = query.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
    mask = _visible_mask(q_len, first_key, context_len, sliding_window)
    if mask is not None:
        mask = mask.repeat(group, 1)
    attended = F.scaled_dot_product_attention(
        folded, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return attended.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Attention over a validated batch; writes into ``out`` and returns it.

    One gather buffer per call, reused by every sequence: fresh allocations of this size would be
    page-faulted in each time, and a reused buffer stays in the CPU cache for the attention.
    """
    block_size, num_kv_heads, group = batch.block_size, batch.num_kv_heads, batch.group_size
    head_dim = batch.head_dim
    tables = block_tables.to(device=k_cache.device, dtype=torch.int64)
    max_blocks = max((-(-ctx // block_size) for ctx in batch.context_lens), default=0) + 1
    k_buffer = k_cache.new_empty((max_blocks, *k_cache.shape[1:]))
    v_buffer = v_cache.new_empty((max_blocks, *v_cache.shape[1:]))
    for seq in range(batch.num_seqs):
        q_len, context_len = batch.query_lens[seq], batch.context_lens[seq]
        if q_len == 0:
            continue
        start = batch.query_starts[seq]
        first_query = context_len - q_len
        first_key = 0 if sliding_window is None else max(0, first_query - sliding_window + 1)
        first_block = first_key // block_size
        last_block = -(-context_len // block_size)
        ids = tables[seq, first_block:last_block]
        count = last_block - first_block
        skip = first_key - first_block * block_size
        keys = torch.index_select(k_cache, 0, ids, out=k_buffer[:count])
        values = torch.index_select(v_cache, 0, ids, out=v_buffer[:count])
        keys = keys.view(-1, num_kv_heads, head_dim)[skip : skip + context_len - first_key]
        values = values.view(-1, num_kv_heads, head_dim)[skip : skip + context_len - first_key]
        q = query[start : start + q_len].view(q_len, num_kv_heads, group, head_dim)
        if q_len == 1:
            attended = _decode_one(q[0], keys, values, scale).unsqueeze(0)
        else:
            attended = _prefill_one(q, keys, values, scale, first_key, context_len, sliding_window)
        out[start : start + q_len] = attended.reshape(q_len, num_kv_heads * group, head_dim)
    return out


def copy_blocks(kv_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """One gather and one indexed store over all layers, K and V (destinations never sources)."""
    pairs = pairs.to(device=kv_pool.device, dtype=torch.int64)
    kv_pool.index_copy_(2, pairs[:, 1], kv_pool.index_select(2, pairs[:, 0]))
