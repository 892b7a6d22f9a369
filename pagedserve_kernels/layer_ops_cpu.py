"""A decoder layer's elementwise work on the CPU by the small native library in
`pagedserve_kernels/csrc/layer_ops_cpu.cpp`: the residual add and RMS norm, rotary embeddings with
the KV write, and silu(gate) * up, one call each instead of 3-20 torch operator calls.

Invariants: each function computes in float32 and rounds once to its output's dtype (float32, or
bfloat16 to nearest even), so it is at least as exact as the same steps in plain torch, which in
bfloat16 round between operators; float32 results equal plain torch's up to float32 summation
order (the norm's mean) and the last bits of the exponential (silu). Operands are contiguous
CPU tensors of the documented dtypes; `fits` says whether a set of them is, and callers keep the
torch path where not. The library is built by pip at install time for AVX-512 and for AVX2 with
FMA (`supported_isas()`, fastest first; each function's `isa=` forces one, so tests run each this
CPU has); `available()` is false where it was not built or the CPU lacks AVX2 and FMA.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedserve_kernels.native import FLAG, POINTER, SIZE, NativeLibrary

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _native() -> NativeLibrary:
    """The library as this process loaded it (`pagedserve_kernels.native.NativeLibrary`)."""
    signatures = {
        "add_rms_norm": [FLAG, POINTER, POINTER, FLAG, POINTER, FLAG, ctypes.c_float, SIZE, SIZE,
                         POINTER, FLAG],
        "rotary_write_kv": [FLAG, POINTER, SIZE, FLAG, SIZE, SIZE, SIZE, SIZE, POINTER, POINTER,
                            POINTER, POINTER, POINTER, POINTER],
        "silu_mul": [FLAG, POINTER, FLAG, SIZE, SIZE, POINTER],
    }  # fmt: skip
    return NativeLibrary.load(
        "pagedserve_kernels._layer_ops_cpu",
        "layer_ops_supported",
        signatures,
        "layer_ops_isa_supported",
    )


def available() -> bool:
    """Whether the native library was built and this CPU runs it (AVX2 and FMA at least)."""
    return _native().available()


def supported_isas() -> tuple[str, ...]:
    """The instruction sets (`pagedserve_kernels.native.VECTOR_ISAS`) this CPU runs the library
    with, fastest first."""
    return _native().isas


def best_isa() -> str | None:
    """The fastest instruction set this CPU runs the library with (None: none)."""
    return _native().best_isa()


def fits(*tensors: torch.Tensor) -> bool:
    """Whether these operands can go to the library: contiguous CPU tensors of float32 or
    bfloat16."""
    return available() and all(
        t.device.type == "cpu" and t.dtype in NATIVE_DTYPES and t.is_contiguous() for t in tensors
    )


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"{name} failed with status {status}")


def _bf16(tensor: torch.Tensor) -> int:
    return int(tensor.dtype == torch.bfloat16)


def add_rms_norm(
    residual: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
    isa: str | None = None,
) -> torch.Tensor:
    """`residual += delta` in place (when given), then the RMS norm of each row of `residual`
    times `weight`, as a new `[rows, hidden]` tensor in `out_dtype`.

    `residual` float32 `[rows, hidden]`; `delta` the same shape (float32 or bfloat16); `weight`
    `[hidden]`; all contiguous (`fits`). `isa`: one of `supported_isas()` (None: the fastest)."""
    library = _native().handle
    assert library is not None, "callers check fits() first"
    rows, hidden = residual.shape
    if residual.dtype != torch.float32 or weight.shape != (hidden,):
        raise ValueError("add_rms_norm: float32 residual [rows, hidden] and weight [hidden]")
    if delta is not None and delta.shape != residual.shape:
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} != {tuple(residual.shape)}")
    out = torch.empty(rows, hidden, dtype=out_dtype)
    status = library.add_rms_norm(
        _native().isa_number(isa),
        residual.data_ptr(),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else _bf16(delta),
        weight.data_ptr(),
        _bf16(weight),
        eps,
        rows,
        hidden,
        out.data_ptr(),
        _bf16(out),
    )
    _check(status, "add_rms_norm")
    return out


def rotary_write_kv(
    qkv: torch.Tensor,
    heads: tuple[int, int, int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    isa: str | None = None,
) -> torch.Tensor:
    """Rotary embeddings (rotate-half) of a fused QKV projection's query and key heads; writes
    the rotated keys and the values to slot `slots[t]` of the caches (skipping -1) and returns
    the rotated queries `[tokens, num_q, head_dim]`.

    `qkv` `[tokens, (num_q + 2 num_kv) head_dim]` with `heads = (num_q, num_kv, head_dim)`; `cos`
    and `sin` float32 `[tokens, head_dim]`; `slots` int64 `[tokens]`, validated (in range,
    distinct); caches `[blocks, block_size, num_kv, head_dim]` in `qkv`'s dtype. `isa`: one of
    `supported_isas()` (None: the fastest)."""
    library = _native().handle
    assert library is not None, "callers check fits() first"
    num_q, num_kv, head_dim = heads
    tokens = qkv.shape[0]
    if qkv.shape[1] != (num_q + 2 * num_kv) * head_dim or k_cache.dtype != qkv.dtype:
        raise ValueError("rotary_write_kv: qkv width or cache dtype does not match the heads")
    if tuple(k_cache.shape[2:]) != (num_kv, head_dim) or k_cache.shape != v_cache.shape:
        raise ValueError(f"rotary_write_kv: caches {tuple(k_cache.shape)} for {heads}")
    if cos.shape != (tokens, head_dim) or sin.shape != cos.shape or cos.dtype != torch.float32:
        raise ValueError("rotary_write_kv: cos and sin must be float32 [tokens, head_dim]")
    if slots.dtype != torch.int64 or slots.shape != (tokens,):
        raise ValueError("rotary_write_kv: slots must be int64 [tokens]")
    q = torch.empty(tokens, num_q, head_dim, dtype=qkv.dtype)
    status = library.rotary_write_kv(
        _native().isa_number(isa),
        qkv.data_ptr(),
        qkv.stride(0),
        _bf16(qkv),
        tokens,
        num_q,
        num_kv,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        q.data_ptr(),
    )
    _check(status, "rotary_write_kv")
    return q


def silu_mul(gate_up: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """`silu(gate) * up` of `gate_up` `[rows, 2 width]` (`[gate | up]`), as `[rows, width]`;
    `isa`: one of `supported_isas()` (None: the fastest)."""
    library = _native().handle
    assert library is not None, "callers check fits() first"
    rows, double = gate_up.shape
    if double % 2:
        raise ValueError(f"silu_mul: odd width {double}")
    out = torch.empty(rows, double // 2, dtype=gate_up.dtype)
    number = _native().isa_number(isa)
    _check(library.silu_mul(number, gate_up.data_ptr(), _bf16(gate_up), rows, double // 2,
                            out.data_ptr()), "silu_mul")  # fmt: skip
    return out
