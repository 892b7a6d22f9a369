"""Input checks shared by every implementation of the kernels API.

Every public function validates its arguments here and raises ``ValueError`` naming the problem
before anything is launched, so a bad slot or block id can never become a silent wrong result or
an illegal memory access. Checks on values (slots, block ids, lengths) read the small metadata
tensors on the host; on CUDA that costs one device-to-host copy of metadata per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve_kernels import kv_quant

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES: tuple[torch.dtype, ...] = (*SUPPORTED_DTYPES, torch.int8, kv_quant.FP8_DTYPE)
"""What a KV cache may hold: the compute dtypes, int8 codes with scales, or fp8 values."""
SUPPORTED_HEAD_DIMS: tuple[int, ...] = (32, 64, 80, 96, 128, 256)
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
KV_POOL_DIMS = 6


@dataclass(frozen=True)
class AttentionBatch:
    """Host-side view of a validated paged-attention batch.

    Invariants: ``query_starts[s] + query_lens[s] == query_starts[s + 1]``-style packing,
    ``0 <= query_lens[s] <= context_lens[s] <= max_blocks * block_size`` and every block id a
    sequence uses (the first ``ceil(context_lens[s] / block_size)`` entries of its row) is a valid
    block of the cache.
    """

    query_starts: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_size: int
    num_kv_heads: int
    group_size: int
    head_dim: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens, default=0)


def _fail(message: str) -> None:
    raise ValueError(message)


def _check_index_tensor(name: str, tensor: torch.Tensor, dims: int, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != dims:
        _fail(f"{name} must have {dims} dimension(s), got shape {tuple(tensor.shape)}")
    if tensor.dtype not in INDEX_DTYPES:
        _fail(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.device.type != "cpu" and tensor.device != device:
        _fail(f"{name} is on {tensor.device} but the data is on {device}")


def _check_float_tensor(
    name: str, tensor: torch.Tensor, dims: int, dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
) -> None:
    if not isinstance(tensor, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != dims:
        _fail(f"{name} must have {dims} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        _fail(f"{name} has unsupported dtype {tensor.dtype}; supported: {dtypes}")


def _check_compute_dtype(name: str, dtype: torch.dtype, cache: torch.Tensor) -> None:
    """A tensor of the model's dtype beside `cache`: the cache's own dtype, or any compute dtype
    when the cache is quantized."""
    if kv_quant.is_quantized(cache):
        return
    if dtype != cache.dtype:
        _fail(f"{name} dtype {dtype} differs from cache dtype {cache.dtype}")


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V caches ``[num_blocks, block_size, H_kv, width]`` (``width``: the head dim, plus
    the scale's bytes for int8 caches): same shape, dtype, device."""
    _check_float_tensor("k_cache", k_cache, 4, CACHE_DTYPES)
    _check_float_tensor("v_cache", v_cache, 4, CACHE_DTYPES)
    if k_cache.shape != v_cache.shape:
        _fail(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if k_cache.dtype != v_cache.dtype:
        _fail(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ in dtype")
    if k_cache.device != v_cache.device:
        _fail(f"k_cache on {k_cache.device} and v_cache on {v_cache.device}")
    if kv_quant.head_dim_of(k_cache) not in SUPPORTED_HEAD_DIMS:
        _fail(
            f"head_dim {kv_quant.head_dim_of(k_cache)} unsupported; "
            f"supported: {SUPPORTED_HEAD_DIMS}"
        )
    if k_cache.shape[0] < 1 or k_cache.shape[1] < 1 or k_cache.shape[2] < 1:
        _fail(f"cache shape {tuple(k_cache.shape)} has an empty dimension")


def check_kv_operands(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """Cheap facts of a KV write (no values read): shapes, dtypes, devices, contiguity."""
    check_cache_pair(k_cache, v_cache)
    _check_float_tensor("key", key, 3)
    _check_float_tensor("value", value, 3)
    if key.shape != value.shape:
        _fail(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    num_kv_heads, head_dim = k_cache.shape[2], kv_quant.head_dim_of(k_cache)
    if tuple(key.shape[1:]) != (num_kv_heads, head_dim):
        _fail(
            f"key/value heads x dim {tuple(key.shape[1:])} do not match the cache's "
            f"({num_kv_heads}, {head_dim})"
        )
    _check_compute_dtype("key", key.dtype, k_cache)
    _check_compute_dtype("value", value.dtype, k_cache)
    if key.dtype != value.dtype:
        _fail(f"key dtype {key.dtype} and value dtype {value.dtype} differ")
    if key.device != k_cache.device or value.device != k_cache.device:
        _fail(f"key/value on {key.device}/{value.device} but the cache is on {k_cache.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        _fail("k_cache and v_cache must be contiguous (a layer's views of the KV pool are)")


def check_slot_mapping(
    slot_mapping: torch.Tensor, num_tokens: int, num_slots: int, device: torch.device
) -> torch.Tensor:
    """Slots are -1 or in ``[0, num_slots)``, one per token, none twice; returns the host copy."""
    _check_index_tensor("slot_mapping", slot_mapping, 1, device)
    if slot_mapping.shape[0] != num_tokens:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    slots = slot_mapping.detach().to("cpu", torch.int64)
    if slots.numel() == 0:
        return slots
    if int(slots.min()) < -1 or int(slots.max()) >= num_slots:
        _fail(
            f"slot_mapping has slots outside [-1, {num_slots}): min {int(slots.min())}, "
            f"max {int(slots.max())}"
        )
    written = slots[slots >= 0]
    if written.unique().numel() != written.numel():
        _fail("slot_mapping writes the same slot more than once in one call")
    return slots


def check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Validate a KV write: shapes agree, slots are -1 or in range, and no slot is written twice."""
    check_kv_operands(key, value, k_cache, v_cache)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    check_slot_mapping(slot_mapping, key.shape[0], num_slots, k_cache.device)


def check_attention_operands(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor | None,
    softcap: float | None = None,
) -> None:
    """Cheap facts of an attention call (no values read): shapes, dtypes, devices, scale, window,
    soft cap."""
    check_cache_pair(k_cache, v_cache)
    _check_float_tensor("query", query, 3)
    num_kv_heads, head_dim = k_cache.shape[2], kv_quant.head_dim_of(k_cache)
    num_q_heads, q_head_dim = query.shape[1], query.shape[2]
    if q_head_dim != head_dim:
        _fail(f"query head_dim {q_head_dim} differs from the cache's {head_dim}")
    if num_q_heads % num_kv_heads != 0:
        _fail(f"query heads {num_q_heads} is not a multiple of KV heads {num_kv_heads}")
    _check_compute_dtype("query", query.dtype, k_cache)
    if query.device != k_cache.device:
        _fail(f"query on {query.device} but the cache is on {k_cache.device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale:
        _fail(f"scale must be a finite number, got {scale!r}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        _fail(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not 0.0 < softcap < float("inf")
    ):
        _fail(f"softcap must be None or a positive finite number, got {softcap!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != query.shape:
            _fail(f"out must be a tensor shaped like query {tuple(query.shape)}")
        if out.dtype != query.dtype or out.device != query.device:
            _fail(f"out must have query's dtype {query.dtype} and device {query.device}")


@dataclass(frozen=True)
class CheckedLengths:
    """Host copies of validated attention metadata (int64)."""

    cu_query_lens: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor


def check_attention_metadata(
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    device: torch.device,
) -> CheckedLengths:
    """Value checks of the per-step metadata: packing, lengths, capacity and used block ids."""
    _check_index_tensor("cu_query_lens", cu_query_lens, 1, device)
    _check_index_tensor("context_lens", context_lens, 1, device)
    _check_index_tensor("block_tables", block_tables, 2, device)
    num_seqs = context_lens.shape[0]
    if cu_query_lens.shape[0] != num_seqs + 1:
        _fail(
            f"cu_query_lens has {cu_query_lens.shape[0]} entries for {num_seqs} sequences "
            f"(expected {num_seqs + 1})"
        )
    if block_tables.shape[0] != num_seqs:
        _fail(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    cu = cu_query_lens.detach().to("cpu", torch.int64)
    ctx = context_lens.detach().to("cpu", torch.int64)
    if num_seqs == 0:
        if num_tokens != 0:
            _fail(f"no sequences but {num_tokens} query tokens")
    elif int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        _fail(
            f"cu_query_lens must start at 0 and end at num_tokens {num_tokens}, "
            f"got {int(cu[0])}..{int(cu[-1])}"
        )
    q_lens = cu[1:] - cu[:-1]
    if bool((q_lens < 0).any()):
        _fail("cu_query_lens must be non-decreasing")
    if bool((q_lens > ctx).any()):
        seq = int(torch.nonzero(q_lens > ctx)[0])
        _fail(f"sequence {seq} has {int(q_lens[seq])} query tokens but context_len {int(ctx[seq])}")
    max_blocks = block_tables.shape[1]
    if num_seqs and int(ctx.max()) > max_blocks * block_size:
        _fail(
            f"a context_len of {int(ctx.max())} exceeds block_tables capacity "
            f"{max_blocks} x {block_size}"
        )
    tables = block_tables.detach().to("cpu", torch.int64)
    if num_seqs and max_blocks:
        blocks_used = (ctx + block_size - 1) // block_size
        used = torch.arange(max_blocks).unsqueeze(0) < blocks_used.unsqueeze(1)
        ids = tables[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            _fail(f"block_tables holds block ids outside [0, {num_blocks}) within a context")
    return CheckedLengths(cu, q_lens, ctx, tables)


def check_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor | None,
    softcap: float | None = None,
) -> AttentionBatch:
    """Validate a paged-attention call and return its host-side batch description."""
    check_attention_operands(query, k_cache, v_cache, scale, sliding_window, out, softcap)
    checked = check_attention_metadata(
        cu_query_lens,
        context_lens,
        block_tables,
        num_tokens=query.shape[0],
        num_blocks=k_cache.shape[0],
        block_size=k_cache.shape[1],
        device=query.device,
    )
    return AttentionBatch(
        query_starts=tuple(checked.cu_query_lens[:-1].tolist()),
        query_lens=tuple(checked.query_lens.tolist()),
        context_lens=tuple(checked.context_lens.tolist()),
        block_size=k_cache.shape[1],
        num_kv_heads=k_cache.shape[2],
        group_size=query.shape[1] // k_cache.shape[2],
        head_dim=kv_quant.head_dim_of(k_cache),
    )


def _check_pool(name: str, pool: torch.Tensor) -> None:
    if not isinstance(pool, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dim() != KV_POOL_DIMS or pool.shape[1] != 2:
        _fail(
            f"{name} must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(pool.shape)}"
        )


def _check_pairs(
    pairs: torch.Tensor, num_src: int, num_dst: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(pairs, torch.Tensor):
        _fail(f"pairs must be a torch.Tensor, got {type(pairs).__name__}")
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        _fail(f"pairs must be [P, 2] (src, dst), got {tuple(pairs.shape)}")
    if pairs.dtype not in INDEX_DTYPES:
        _fail(f"pairs must be int32 or int64, got {pairs.dtype}")
    host = pairs.detach().to("cpu", torch.int64)
    src, dst = host[:, 0], host[:, 1]
    if src.numel():
        if int(src.min()) < 0 or int(src.max()) >= num_src:
            _fail(f"source block ids outside [0, {num_src})")
        if int(dst.min()) < 0 or int(dst.max()) >= num_dst:
            _fail(f"destination block ids outside [0, {num_dst})")
        if dst.unique().numel() != dst.numel():
            _fail("a destination block appears more than once in pairs")
    return src, dst


def check_copy_blocks(kv_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy pairs: ids in range, destinations distinct and never also a source (order-free)."""
    _check_pool("kv_pool", kv_pool)
    src, dst = _check_pairs(pairs, kv_pool.shape[2], kv_pool.shape[2])
    if src.numel() and bool(torch.isin(dst, src).any()):
        _fail("a destination block is also a source block in the same copy_blocks call")
    if not kv_pool.is_contiguous():
        _fail("kv_pool must be contiguous (as allocate_kv_pool returns it)")


def check_swap_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Swap pairs: pools agree in every dimension but the block count; ids in range."""
    _check_pool("src_pool", src_pool)
    _check_pool("dst_pool", dst_pool)
    if src_pool.dtype != dst_pool.dtype:
        _fail(f"src_pool {src_pool.dtype} and dst_pool {dst_pool.dtype} differ in dtype")
    src_shape, dst_shape = tuple(src_pool.shape), tuple(dst_pool.shape)
    if src_shape[:2] + src_shape[3:] != dst_shape[:2] + dst_shape[3:]:
        _fail(f"src_pool {src_shape} and dst_pool {dst_shape} differ beyond the block count")
    if src_pool.device == dst_pool.device and src_pool.data_ptr() == dst_pool.data_ptr():
        _fail("src_pool and dst_pool are the same tensor; use copy_blocks within one pool")
    _check_pairs(pairs, src_pool.shape[2], dst_pool.shape[2])
