"""The CPU path: the native kernel where it applies, plain torch for the rest.

Every query row of a float32 or bfloat16 cache (decodes and prefill chunks alike) goes to
``pagedserve_kernels.attention_cpu`` (one native call per layer reading the blocks in place) when
it is built; what follows describes the torch path, used for the operands the native kernel does
not take (float16, head sizes not a multiple of 16, a soft cap) and where it is not built.

Works from a ``PreparedAttention`` (``pagedserve_kernels.metadata``): the per-step gather indices,
masks and write slots are computed once and every layer reuses them. Decodes are attended in a
handful of batched calls: the decode sequences, sorted by context length, are cut into groups whose
padded gather stays bounded (``DECODE_GROUP_TOKENS``); one ``index_select`` per cache gathers a
group's blocks into a reused ``[seqs, width * block_size, H_kv, D]`` buffer; then either two ``bmm``
calls over that buffer as it lies (``_all_heads``: bfloat16, few KV heads, at least
``FOLDED_MIN_SEQS`` sequences) or one ``scaled_dot_product_attention`` call with a key mask, GQA
folded into the query rows (``[seqs, H_kv, group, D]``). Neither repeats or copies a K/V head.
A prefill chunk (several query tokens) gathers its own blocks and attends with one causal SDPA
call. With a soft cap on the scores (SDPA has none, nor has the native kernel) every call is
the explicit float32 product, cap, mask and softmax of ``capped_attention`` instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve_kernels import attention_cpu, kv_quant
from pagedserve_kernels.metadata import DecodeGroup, PreparedAttention


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor | None,
) -> None:
    """Copy token ``rows`` (all when None) into int64 ``slots`` of the ``[num_slots, H_kv, W]``
    views of the caches (validated: in range, distinct), encoded as the caches store them
    (``kv_quant.encode``: int8 codes and scales, fp8, or as given)."""
    if rows is not None:
        key, value = key.index_select(0, rows), value.index_select(0, rows)
    key, value = kv_quant.encode(key, k_cache.dtype), kv_quant.encode(value, v_cache.dtype)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value)


def capped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """SDPA's computation with each scaled score ``s`` capped to ``softcap * tanh(s / softcap)``,
    in float32: ``query [..., rows, D]``, ``keys`` / ``values`` ``[..., n, D]`` (broadcast like
    SDPA's), ``mask`` boolean (True: visible) or additive, broadcast to ``[..., rows, n]``.
    Returns ``[..., rows, D]`` in the query's dtype."""
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask.float()
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, values.float()).to(query.dtype)


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
    softcap: float | None = None,
) -> torch.Tensor:
    """Several query tokens ``[q_len, H_kv, group, D]`` over keys/values ``[n, H_kv, D]``.

    GQA is folded into the rows (``[1, H_kv, group * q_len, D]``) so no K/V head is repeated.
    The batch dimension of one is what lets SDPA take its blocked CPU kernel with a mask (on
    three-dimensional inputs it falls back to the explicit math path). Returns
    ``[q_len, H_kv, group, D]`` in the query's dtype.
    """
    q_len, num_kv_heads, group, head_dim = query.shape
    folded = query.permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * q_len, head_dim)
    keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    mask = _visible_mask(q_len, first_key, context_len, sliding_window)
    if mask is not None:
        mask = mask.repeat(group, 1)
    if softcap is not None:
        attended = capped_attention(folded, keys, values, mask, scale, softcap)
    else:
        attended = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
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


FOLDED_MAX_KV_HEADS = 4
"""Decode groups of bfloat16 caches with at most this many KV heads attend with `_all_heads`
(it does `H_kv` times the useful products)..."""

FOLDED_MIN_SEQS = 4
"""...when they hold at least this many sequences (below, SDPA's fixed cost is lower)."""


def _all_heads(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Decode attention by two plain ``bmm`` calls on the gathered buffers, no copy of K or V.

    ``q`` ``[seqs, H_kv, group, D]``; ``keys``/``values`` ``[seqs, T, H_kv, D]`` (contiguous, as
    gathered); ``bias`` float32 ``[seqs, 1, 1, T]`` or None. Each sequence's keys are one
    contiguous ``[T * H_kv, D]`` matrix, so every query head is multiplied against every KV head
    (``H_kv`` times the useful work, on matrices oneDNN handles well) and the matching
    ``H_kv`` diagonal blocks are kept; likewise for the values. Softmax runs in float32 over
    the products (rounded to the cache dtype by ``bmm``). Returns ``[seqs, H_kv * group, D]``.
    SDPA on the same buffers reads K and V through strided head views, which is slower.
    """
    seqs, num_kv_heads, group, head_dim = q.shape
    keys_len = keys.shape[1]
    rows = num_kv_heads * group
    products = torch.bmm(q.reshape(seqs, rows, head_dim), keys.view(seqs, -1, head_dim).mT)
    scores = products.view(seqs, num_kv_heads, group, keys_len, num_kv_heads)
    scores = scores.diagonal(dim1=1, dim2=4).permute(0, 3, 1, 2).to(torch.float32)
    scores.mul_(scale)
    if bias is not None:
        scores += bias
    weights = torch.softmax(scores, -1).to(q.dtype).view(seqs, rows, keys_len)
    mixed = torch.bmm(weights, values.view(seqs, keys_len, -1))
    mixed = mixed.view(seqs, num_kv_heads, group, num_kv_heads, head_dim)
    return mixed.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(seqs, rows, head_dim)


def _folds(dtype: torch.dtype, num_kv_heads: int, num_seqs: int) -> bool:
    """Whether a decode group attends with ``_all_heads`` rather than SDPA: bfloat16 keys of
    few KV heads and at least ``FOLDED_MIN_SEQS`` sequences, where it measured faster than SDPA
    (1.1-1.3x at 4-32 sequences of 3 KV heads; slower at 1-2)."""
    return (
        dtype == torch.bfloat16
        and num_kv_heads <= FOLDED_MAX_KV_HEADS
        and num_seqs >= FOLDED_MIN_SEQS
    )


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
    softcap: float | None = None,
) -> None:
    """One gather per cache and one attention call for every decode of ``group``; fills its rows.

    ``key_bias`` is the group's key mask already in the dtype the call wants (None: no mask):
    float32 for ``_all_heads`` (bfloat16 caches with few KV heads), the query's for SDPA.
    A quantized cache's gathered blocks are decoded to the query's dtype (this path only; the
    native kernel reads the codes in place)."""
    block_size, num_kv_heads, group_size, head_dim = geometry
    seqs, count = group.num_seqs, group.block_ids.shape[0]
    width = buffers[0].shape[-1] // num_kv_heads // block_size
    shape = (seqs, group.width * block_size, num_kv_heads, width)
    keys = torch.index_select(k_flat, 0, group.block_ids, out=buffers[0][:count]).view(shape)
    values = torch.index_select(v_flat, 0, group.block_ids, out=buffers[1][:count]).view(shape)
    keys, values = kv_quant.decode(keys, query.dtype), kv_quant.decode(values, query.dtype)
    if group.row_range is not None:
        q = query[group.row_range[0] : group.row_range[1]]
    else:
        q = query.index_select(0, group.rows)
    q = q.reshape(seqs, num_kv_heads, group_size, head_dim)
    folded = _folds(query.dtype, num_kv_heads, seqs) and softcap is None
    if sliding_window is not None:
        dtype = torch.float32 if folded else query.dtype
        bias = _window_bias(group, block_size, sliding_window, dtype)
    else:
        bias = key_bias
    if softcap is not None:
        attended = capped_attention(
            q, keys.transpose(1, 2), values.transpose(1, 2), bias, scale, softcap
        ).reshape(seqs, num_kv_heads * group_size, head_dim)
    elif folded:
        attended = _all_heads(q, keys, values, bias, scale)
    else:
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
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention over validated, prepared metadata; writes into ``out`` and returns it
    (``softcap``: see ``pagedserve_kernels.paged_attention``).

    Where the native kernel takes the operands, every query row (decodes and prefill chunks
    alike) runs in one call of it; otherwise decodes attend in padded groups and each prefill
    chunk through SDPA."""
    rows = metadata.query_rows
    if (
        rows is not None
        and softcap is None  # the native kernel has no soft cap
        and attention_cpu.accepts(query, k_cache, v_cache, out)
    ):
        attention_cpu.decode_attention(query, k_cache, v_cache, rows, scale, sliding_window, out)
        return out
    block_size, num_kv_heads, width = k_cache.shape[1:]
    head_dim = kv_quant.head_dim_of(k_cache)
    group_size = query.shape[1] // num_kv_heads
    geometry = (block_size, num_kv_heads, group_size, head_dim)
    k_flat = k_cache.reshape(k_cache.shape[0], -1)  # a view: a layer's cache is contiguous
    v_flat = v_cache.reshape(v_cache.shape[0], -1)
    workspace = metadata.workspace
    buffers = workspace.buffers(k_cache)
    for index, group in enumerate(metadata.decode_groups):
        folded = _folds(query.dtype, num_kv_heads, group.num_seqs) and softcap is None
        bias = workspace.key_bias(index, group, torch.float32 if folded else query.dtype)
        _attend_decodes(
            query, k_flat, v_flat, buffers, group, bias, geometry, scale, sliding_window, out,
            softcap,
        )  # fmt: skip
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
        keys = keys.view(-1, num_kv_heads, width)[skip : skip + context_len - first_key]
        values = values.view(-1, num_kv_heads, width)[skip : skip + context_len - first_key]
        keys, values = kv_quant.decode(keys, query.dtype), kv_quant.decode(values, query.dtype)
        q = query[start : start + q_len].reshape(q_len, num_kv_heads, group_size, head_dim)
        attended = _prefill_one(
            q, keys, values, scale, first_key, context_len, sliding_window, softcap
        )
        out[start : start + q_len] = attended.reshape(q_len, num_kv_heads * group_size, head_dim)
    return out


def copy_blocks(kv_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """One gather and one indexed store over all layers, K and V (destinations never sources)."""
    pairs = pairs.to(device=kv_pool.device, dtype=torch.int64)
    kv_pool.index_copy_(2, pairs[:, 1], kv_pool.index_select(2, pairs[:, 0]))
