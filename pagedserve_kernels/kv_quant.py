"""Quantized KV caches: what `kv_cache_dtype` stores, and the int8 cache's codes and scales.

`kv_cache_dtype` takes vLLM's values: "auto" (the model's dtype), "int8" (CPU) and
"fp8_e4m3" with its alias "fp8" (CUDA). The storage of each:

- int8: every (token, KV head) vector of `head_dim` values is stored as `head_dim` int8 codes
  followed by its scale, one bfloat16 in the next `SCALE_BYTES` bytes, so a cache's last
  dimension is `head_dim + SCALE_BYTES` int8 elements. The scale is the vector's absolute
  maximum / 127 rounded to bfloat16, and the codes are the values divided by that rounded scale,
  rounded to nearest and clamped to [-127, 127]: a value is read back as `code * scale`, within
  half a scale of what was written. Per token and head (not per block and head) because a block
  then never has to be re-quantized when a later token raises its maximum, each token's error is
  bounded by its own maximum, and the scale costs 2 bytes per `head_dim` (3 % at 64).
  Keeping the scale inside the vector's row means every block-level operation (copy-on-write,
  swaps to the CPU tier, block transfers between replicas, their checksums) moves the scales with
  the codes without knowing about them.
- fp8_e4m3: `torch.float8_e4m3fn` values with a scale of 1 (vLLM's default when no calibrated
  scales are given), `head_dim` per vector.

Invariant: a cache tensor's dtype says how it is stored (int8: codes and scales; float8: fp8
values; else the model's dtype), so kernels dispatch on the tensor, never on a setting.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")
"""The accepted `kv_cache_dtype` values (vLLM's spelling)."""

ALIASES = {"fp8": "fp8_e4m3"}

SCALE_BYTES = 2
"""Bytes after each int8 vector's codes holding its bfloat16 scale."""

INT8_MAX = 127

FP8_DTYPE = torch.float8_e4m3fn


def canonical(kv_cache_dtype: str) -> str:
    """The one name of a `kv_cache_dtype` value ("fp8" is "fp8_e4m3"); ValueError if unknown."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {list(KV_CACHE_DTYPES)}")
    return ALIASES.get(kv_cache_dtype, kv_cache_dtype)


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a KV pool that keeps `kv_cache_dtype` for a model computing in
    `model_dtype`."""
    name = canonical(kv_cache_dtype)
    if name == "int8":
        return torch.int8
    if name == "fp8_e4m3":
        return FP8_DTYPE
    return model_dtype


def is_int8(cache: torch.Tensor) -> bool:
    """Whether `cache` holds int8 codes with their scales."""
    return cache.dtype == torch.int8


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether `cache` stores values in another dtype than the model computes in."""
    return cache.dtype in (torch.int8, FP8_DTYPE)


def stored_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of a cache's last dimension holding one `head_dim` vector in `dtype`."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head dimension of the vectors `cache` stores (its last dimension, less the scale)."""
    return cache.shape[-1] - SCALE_BYTES if is_int8(cache) else cache.shape[-1]


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def quantize_int8(values: torch.Tensor) -> torch.Tensor:
    """Vectors `[..., D]` (any float dtype) as int8 rows `[..., D + SCALE_BYTES]`: codes, then
    the bfloat16 scale's two bytes (see the module docstring)."""
    head_dim = values.shape[-1]
    wide = values.float()
    scale = (wide.abs().amax(-1, keepdim=True) / INT8_MAX).to(torch.bfloat16)
    divisor = scale.float()
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    codes = torch.round(wide / divisor).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    shape = (*values.shape[:-1], head_dim + SCALE_BYTES)
    rows = torch.empty(shape, dtype=torch.int8, device=values.device)
    rows[..., :head_dim] = codes
    rows[..., head_dim:] = scale.view(torch.int8)
    return rows


def int8_scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales `[..., 1]` of int8 rows `[..., D + SCALE_BYTES]`."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.bfloat16).float()


def dequantize_int8(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Int8 rows `[..., D + SCALE_BYTES]` read back as `[..., D]` in `dtype`: code * scale, in
    float32, rounded once to `dtype`."""
    codes = rows[..., :-SCALE_BYTES].float()
    return (codes * int8_scales(rows)).to(dtype)


def encode(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Vectors `[..., D]` as a cache of `cache_dtype` stores them."""
    if cache_dtype == torch.int8:
        return quantize_int8(values)
    return values.to(cache_dtype)


def decode(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored vectors (any cache dtype) read back as `[..., D]` in `dtype`."""
    if stored.dtype == torch.int8:
        return dequantize_int8(stored, dtype)
    return stored.to(dtype)
