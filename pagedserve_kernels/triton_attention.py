"""Triton paged attention for a mixed batch of prefill chunks and decodes, with split-KV.

One launch covers the whole batch. The grid is ``(query tiles, KV heads, KV splits)``:

* A *query tile* is up to ``BLOCK_M // group`` consecutive query tokens of one sequence; its
  rows are (token, query head of the KV head's group) pairs, so GQA reads each K/V tile once for the
  whole group. The host builds the tile list from the validated batch, so decodes and long
  prefill chunks share one launch without idle programs.
* Each program walks the sequence's keys ``BLOCK_N`` at a time through the block table (any block
  size: the physical slot is looked up per key), with an online softmax in fp32, restricted to the
  keys its tile can see (causal end, sliding-window start). With a soft cap, each scaled
  score ``s`` becomes ``cap * tanh(s / cap)`` before the softmax.
* *Split-KV* (flash-decoding): when the batch has too few tiles to fill the device, the key range
  is cut into partitions of ``partition_size`` keys; each split writes its normalised partial output
  and log-sum-exp, and a second kernel combines them. With one split the first kernel writes the
  output.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve_kernels.validation import AttentionBatch

LOG2_E = 1.4426950408889634
MAX_SPLITS = 32


@dataclass(frozen=True)
class LaunchPlan:
    """Tile and split sizes of one launch. ``block_m >= group``; partitions are BLOCK_N-aligned."""

    block_m: int
    block_n: int
    num_splits: int
    partition_size: int


@triton.jit(do_not_specialize=["num_tokens", "window", "partition", "softcap"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    tiles_ptr, cu_ptr, ctx_ptr, bt_ptr,
    scale_log2, num_tokens, window, partition, softcap,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tiles_ptr + 2 * tile)
    first_tok = tl.load(tiles_ptr + 2 * tile + 1)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < (BLOCK_M // GROUP) * GROUP) & (tok < q_len)
    pos = ctx - q_len + tok
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM

    q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(
        q_ptr + q_off + dims[None, :] * stride_qd, mask=row_ok[:, None] & dim_ok[None, :], other=0.0
    )

    last_tok = tl.minimum(first_tok + BLOCK_M // GROUP, q_len) - 1
    hi = ctx - q_len + last_tok + 1
    lo = ctx * 0  # an int32 tensor like the window start below (branch types must agree)
    if window > 0:
        lo = tl.maximum(ctx - q_len + first_tok - window + 1, 0)
    if SPLIT:
        lo = tl.maximum(lo, split * partition)
        hi = tl.minimum(hi, (split + 1) * partition)
    lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        block = tl.load(bt_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0)
        block = block.to(tl.int64)
        slot = keys % BLOCK_SIZE
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k_off = block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptr + k_off + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
        k = k.to(q.dtype)  # an fp8 cache's values widened exactly (no-op for the query's dtype)
        if FP32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        if SOFTCAP:  # cap * tanh(s / cap) in natural units, tanh(x) = 1 - 2 / (exp(2x) + 1)
            doubled = tl.exp(2.0 * (s / 1.4426950408889634) / softcap)
            s = softcap * (1.0 - 2.0 / (doubled + 1.0)) * 1.4426950408889634
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if window > 0:
            visible = visible & (keys[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
        v = tl.load(v_ptr + v_off + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
        v = v.to(q.dtype)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    result = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    token = (q_start + tok).to(tl.int64)
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        row = (split * num_tokens + token) * NUM_Q_HEADS + head
        tl.store(part_lse_ptr + row, lse, mask=row_ok)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], result, mask=store_mask)
    else:
        o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(out_ptr + o_off, result.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _combine_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    num_tokens, num_splits,
    stride_ot, stride_oh, stride_od,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    row = (splits * num_tokens + token) * NUM_Q_HEADS + head
    lse = tl.load(part_lse_ptr + row, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.where(split_ok & (lse > float("-inf")), tl.exp2(lse - top), 0.0)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        mask=(weight > 0.0)[:, None] & dim_ok[None, :],
        other=0.0,
    )
    result = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    o_off = token * stride_ot + head * stride_oh + dims * stride_od
    tl.store(out_ptr + o_off, result.to(out_ptr.dtype.element_ty), mask=dim_ok)


def plan_launch(
    batch: AttentionBatch,
    *,
    num_programs_target: int,
    min_partition: int = 512,
    num_splits: int | None = None,
) -> LaunchPlan:
    """Pick tile sizes, and split the keys only when the batch alone cannot fill the device.

    ``num_splits`` forces a split count (tests use it to reach the split path on small shapes).
    """
    group = batch.group_size
    rows = max(batch.max_query_len, 1) * group
    block_m = max(16, triton.next_power_of_2(group))
    if rows > block_m:
        block_m = max(64, block_m)
    block_n = 64 if batch.head_dim <= 128 else 32
    max_ctx = max(batch.max_context_len, 1)
    if num_splits is None:
        tokens_per_tile = block_m // group
        tiles = sum(-(-q // tokens_per_tile) for q in batch.query_lens)
        programs = max(tiles * batch.num_kv_heads, 1)
        by_length = -(-max_ctx // min_partition)
        by_fill = -(-num_programs_target // programs)
        num_splits = max(1, min(by_length, by_fill, MAX_SPLITS))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    partition = -(-max_ctx // num_splits)
    partition = -(-partition // block_n) * block_n
    return LaunchPlan(block_m, block_n, num_splits, partition)


def _tile_table(batch: AttentionBatch, tokens_per_tile: int, device: torch.device) -> torch.Tensor:
    """``[num_tiles, 2]`` int32 of (sequence, first query token of the tile within it)."""
    tiles = [
        (seq, first)
        for seq, q_len in enumerate(batch.query_lens)
        for first in range(0, q_len, tokens_per_tile)
    ]
    return torch.tensor(tiles, dtype=torch.int32).view(-1, 2).to(device)


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """fp32 inputs use exact fp32 dots (no TF32). Triton's CPU interpreter computes bf16 dots
    wrongly, so under ``TRITON_INTERPRET=1`` bf16 tiles are upcast before the dot; on a GPU bf16
    and fp16 use the tensor cores with fp32 accumulation."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return dtype == torch.float32 or (interpreting and dtype == torch.bfloat16)


def _default_program_target(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    *,
    num_splits: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Launch on a batch already checked by ``validation.check_paged_attention``; fills ``out``
    (``softcap``: see ``pagedserve_kernels.paged_attention``)."""
    device = query.device
    plan = plan_launch(
        batch, num_programs_target=_default_program_target(device), num_splits=num_splits
    )
    tiles = _tile_table(batch, plan.block_m // batch.group_size, device)
    if tiles.shape[0] == 0:
        return out
    meta = [t.to(device=device, dtype=torch.int32) for t in (batch_cu(batch), batch_ctx(batch))]
    tables = block_tables.to(device=device, dtype=torch.int32).contiguous()
    num_tokens, num_q_heads, head_dim = query.shape
    split = plan.num_splits > 1
    if split:
        part_out = torch.empty(
            (plan.num_splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=device
        )
        part_lse = torch.empty(
            (plan.num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=device
        )
    else:
        part_out = part_lse = out
    block_d = triton.next_power_of_2(head_dim)
    grid = (tiles.shape[0], batch.num_kv_heads, plan.num_splits)
    _attention_kernel[grid](
        query, k_cache, v_cache, out, part_out, part_lse,
        tiles, meta[0], meta[1], tables,
        scale * LOG2_E, num_tokens, sliding_window or 0, plan.partition_size,
        1.0 if softcap is None else softcap,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        tables.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=batch.group_size, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        BLOCK_SIZE=batch.block_size,
        SPLIT=split, FP32_DOT=_dot_in_fp32(query.dtype), SOFTCAP=softcap is not None,
    )  # fmt: skip
    if split:
        _combine_kernel[(num_tokens, num_q_heads)](
            out, part_out, part_lse,
            num_tokens, plan.num_splits,
            *out.stride(),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim,
            BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(plan.num_splits),
        )  # fmt: skip
    return out


def batch_cu(batch: AttentionBatch) -> torch.Tensor:
    """Cumulative query lengths ``[num_seqs + 1]`` rebuilt from the validated batch."""
    return torch.tensor((*batch.query_starts, sum(batch.query_lens)), dtype=torch.int32)


def batch_ctx(batch: AttentionBatch) -> torch.Tensor:
    """Context lengths ``[num_seqs]`` from the validated batch."""
    return torch.tensor(batch.context_lens, dtype=torch.int32)
