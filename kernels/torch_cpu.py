"""The fast plain-torch path, used for CPU tensors.

Works from a ``PreparedAttention`` (``kernels.metadata``): the per-step gather indices, masks and
write slots are computed once and every layer reuses them. Decodes are attended in a handful of
batched calls: the decode sequences, sorted by context length, are cut into groups whose padded
gather stays bounded (``DECODE_GROUP_TOKENS``); one ``index_select`` per cache gathers a group's
blocks into a reused ``[seqs, width * block_size, H_kv, D]`` buffer and one
``scaled_dot_product_attention`` call attends with a key mask, GQA folded into the query rows
(``[seqs, H_kv, group, D]``) so no K/V head is ever repeated. A prefill chunk (several query
tokens) gathers its own blocks and attends with one causal SDPA call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import DecodeGroup, PreparedAttention


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor | None,
) -> None:
    """Copy token ``rows`` (all when None) into int64 ``slots`` of the ``[num_slots, H_kv, D]``
    views of the caches (validated: in range, distinct)."""
    if rows is not None:
        key, value = key.index_select(0, rows), value.index_select(0, rows)
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


def _window_bias(
    group: DecodeGroup, block_size: int, sliding_window: int, dtype: torch.dtype
) -> torch.Tensor:
    """Key bias of a decode group under a sliding window: positions ``[ctx - window, ctx)``."""
    context_lens = group.context_lens
    positions = torch.arange(group.width * block_size, device=context_lens.device)
    visible = (positions < context_lens) & (positions >= context_lens - sliding_window)
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return bias.masked_fill_(~visible, float("-inf"))


def _attend_decodes(
    query: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    buffers: tuple[torch.Tensor, torch.Tensor],
    group: DecodeGroup,
    key_bias: torch.Tensor | None,
    geometry: tuple[int, int, int, int],
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    """One gather per cache and one SDPA call for every decode of ``group``; fills its rows.

    ``key_bias`` is the group's key mask already in the query's dtype (None: no mask)."""
    block_size, num_kv_heads, group_size, head_dim = geometry
    seqs, count = group.num_seqs, group.block_ids.shape[0]
    shape = (seqs, group.width * block_size, num_kv_heads, head_dim)
    keys = torch.index_select(k_flat, 0, group.block_ids, out=buffers[0][:count]).view(shape)
    values = torch.index_select(v_flat, 0, group.block_ids, out=buffers[1][:count]).view(shape)
    if group.row_range is not None:
        q = query[group.row_range[0] : group.row_range[1]]
    else:
        q = query.index_select(0, group.rows)
    q = q.reshape(seqs, num_kv_heads, group_size, head_dim)
    if sliding_window is not None:
        bias = _window_bias(group, block_size, sliding_window, query.dtype)
    else:
        bias = key_bias
    attended = F.scaled_dot_product_attention(
        q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=bias, scale=scale
    ).reshape(seqs, num_kv_heads * group_size, head_dim)
    if group.row_range is not None:
        out[group.row_range[0] : group.row_range[1]] = attended
    else:
        out.index_copy_(0, group.rows, attended)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: PreparedAttention,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Attention over validated, prepared metadata; writes into ``out`` and returns it."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group_size = query.shape[1] // num_kv_heads
    geometry = (block_size, num_kv_heads, group_size, head_dim)
    k_flat = k_cache.reshape(k_cache.shape[0], -1)  # a view: a layer's cache is contiguous
    v_flat = v_cache.reshape(v_cache.shape[0], -1)
    workspace = metadata.workspace
    buffers = workspace.buffers(k_cache)
    for index, group in enumerate(metadata.decode_groups):
        bias = workspace.key_bias(index, group, query.dtype)
        _attend_decodes(
            query, k_flat, v_flat, buffers, group, bias, geometry, scale, sliding_window, out
        )
    for chunk in metadata.prefills:
        q_len, context_len, start = chunk.query_len, chunk.context_len, chunk.start
        first_query = context_len - q_len
        first_key = 0 if sliding_window is None else max(0, first_query - sliding_window + 1)
        first_block = first_key // block_size
        ids = chunk.block_ids[first_block:]
        count = ids.shape[0]
        skip = first_key - first_block * block_size
        keys = torch.index_select(k_flat, 0, ids, out=buffers[0][:count])
        values = torch.index_select(v_flat, 0, ids, out=buffers[1][:count])
        keys = keys.view(-1, num_kv_heads, head_dim)[skip : skip + context_len - first_key]
        values = values.view(-1, num_kv_heads, head_dim)[skip : skip + context_len - first_key]
        q = query[start : start + q_len].reshape(q_len, num_kv_heads, group_size, head_dim)
        attended = _prefill_one(q, keys, values, scale, first_key, context_len, sliding_window)
        out[start : start + q_len] = attended.reshape(q_len, num_kv_heads * group_size, head_dim)
    return out


def copy_blocks(kv_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """One gather and one indexed store over all layers, K and V (destinations never sources)."""
    pairs = pairs.to(device=kv_pool.device, dtype=torch.int64)
    kv_pool.index_copy_(2, pairs[:, 1], kv_pool.index_select(2, pairs[:, 0]))
