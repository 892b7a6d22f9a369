"""Triton kernels that move KV data: the write by slot mapping and the block copy.

Both take inputs already checked by ``pagedserve_kernels.validation`` (slots and block ids in range,
no slot or destination block written twice), so every store lands inside the tensor it targets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COPY_CHUNK = 1024


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cache_slot, stride_vcache_slot,
    HEAD_DIM: tl.constexpr, NUM_ELEMS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (token, chunk): copies one chunk of the token's ``H_kv * D`` values to its slot.

    The caches are contiguous within a slot (``[H_kv, D]``), so a slot's values are one run.
    """
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + token + tl.zeros([BLOCK], tl.int64))  # broadcast: one slot per lane
    mask = (offs < NUM_ELEMS) & (slot >= 0)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim * stride_vd, mask=mask)
    tl.store(k_cache_ptr + slot * stride_cache_slot + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_vcache_slot + offs, v, mask=mask)


@triton.jit
def _copy_blocks_kernel(
    pool_ptr, pairs_ptr, num_blocks,
    BLOCK_ELEMS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (pair, layer*2 + kv, chunk): copies one chunk of block src onto block dst."""
    pair = tl.program_id(0)
    cache = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    mask = offs < BLOCK_ELEMS
    base = cache * num_blocks * BLOCK_ELEMS
    data = tl.load(pool_ptr + base + src * BLOCK_ELEMS + offs, mask=mask)
    tl.store(pool_ptr + base + dst * BLOCK_ELEMS + offs, data, mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter each token's K/V into its slot (-1 skipped); input validated, caches contiguous.
    An fp8 cache gets the step's K/V rounded by torch first (to nearest even, scale 1): one small
    tensor per call, and the kernel then only copies, the same on a GPU and in the interpreter."""
    if key.shape[0] == 0:
        return
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    slots = slot_mapping.to(device=key.device, dtype=torch.int64).contiguous()
    num_elems = key.shape[1] * key.shape[2]
    block = min(triton.next_power_of_2(num_elems), COPY_CHUNK)
    grid = (key.shape[0], triton.cdiv(num_elems, block))
    _write_kv_kernel[grid](
        key, value, k_cache, v_cache, slots,
        *key.stride(), *value.stride(),
        k_cache.stride(1), v_cache.stride(1),
        HEAD_DIM=key.shape[2], NUM_ELEMS=num_elems, BLOCK=block,
    )  # fmt: skip


def copy_blocks(kv_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """All layers, K and V, all pairs in one launch. Input already validated (contiguous pool)."""
    num_layers, _, num_blocks = kv_pool.shape[:3]
    block_elems = kv_pool[0, 0, 0].numel()
    pairs = pairs.to(device=kv_pool.device, dtype=torch.int64).contiguous()
    block = min(triton.next_power_of_2(block_elems), COPY_CHUNK)
    grid = (pairs.shape[0], num_layers * 2, triton.cdiv(block_elems, block))
    _copy_blocks_kernel[grid](kv_pool, pairs, num_blocks, BLOCK_ELEMS=block_elems, BLOCK=block)
