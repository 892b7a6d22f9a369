"""Paged decode attention on the CPU by the small native kernel in
`pagedserve_kernels/csrc/attention_cpu.cpp`: each query row's keys and values are read in place
through its block table, in float32 after the loads, with one call per layer for every row of the
step.

The plain-torch path (`pagedserve_kernels.torch_cpu`) gathers each group of decodes into a padded
buffer, then multiplies, masks and softmaxes it in a dozen torch calls per layer; this replaces all
of that for the decodes of a float32 or bfloat16 cache. A prefill chunk's query rows run through
the same kernel, each as the decode of its own position (`DecodeRows.of_queries`): about twice
SDPA's speed on the chunks of a chat prompt, and no mask to build.

Invariants: `decode_attention` equals `pagedserve_kernels.reference.paged_attention` on the rows it
fills (float32 arithmetic throughout, the result rounded once to the query's dtype) up to float32
summation order and the last bits of the exponential; it writes only those rows of `out`. The
library is built by pip at install time for AVX-512 and for AVX2 with FMA (`supported_isas()`,
fastest first; `decode_attention(..., isa=)` forces one, so tests run each this CPU has);
`available()` is false where it was not built or the CPU lacks AVX2 and FMA, and `accepts` is
false for what the kernel does not take (other dtypes,
head sizes that are not a multiple of 16, non-contiguous caches): callers then keep the torch
path.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from pagedserve_kernels import kv_quant
from pagedserve_kernels.native import FLAG, POINTER, SIZE, NativeLibrary

MAX_HEAD_DIM = 256
MAX_GROUP = 16
"""Query heads per KV head the kernel takes at most (its C side refuses more)."""


@dataclass(frozen=True)
class DecodeRows:
    """Query rows of one step, each attending as a decode (one query token) does, as the kernel
    reads them: token row `rows[i]` (int64) attends over `context_lens[i]` keys (int32) whose
    blocks are listed by `block_tables[i]` (int32, contiguous). All CPU tensors; ids and lengths
    validated. Row j of a prefill chunk whose first query sits at position p is the decode of
    position p + j: it sees p + j + 1 keys, which is the chunk's causal mask."""

    rows: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor

    @staticmethod
    def of(
        seqs: list[int],
        cu_query_lens: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> DecodeRows:
        """The rows of decode sequences `seqs` from validated CPU metadata."""
        index = torch.tensor(seqs, dtype=torch.int64)
        lens = context_lens.index_select(0, index).to(torch.int32)
        return DecodeRows(
            rows=cu_query_lens.index_select(0, index).to(torch.int64).contiguous(),
            context_lens=lens.contiguous(),
            block_tables=block_tables.index_select(0, index).to(torch.int32).contiguous(),
        )

    @staticmethod
    def of_queries(
        seqs: list[int],
        cu_query_lens: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> DecodeRows:
        """Every query row of sequences `seqs` (decodes and prefill chunks alike) from validated
        CPU metadata, in the sequences' order; each row gets its sequence's block table."""
        index = torch.tensor(seqs, dtype=torch.int64)
        starts = cu_query_lens.index_select(0, index).to(torch.int64)
        q_lens = (cu_query_lens.index_select(0, index + 1) - starts).to(torch.int64)
        last = context_lens.index_select(0, index).to(torch.int64)
        owner = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        offset = torch.arange(owner.shape[0]) - (torch.cumsum(q_lens, 0) - q_lens)[owner]
        return DecodeRows(
            rows=(starts[owner] + offset).contiguous(),
            context_lens=(last - q_lens + 1)[owner].add_(offset).to(torch.int32).contiguous(),
            block_tables=block_tables.index_select(0, index[owner]).to(torch.int32).contiguous(),
        )


@functools.cache
def _native() -> NativeLibrary:
    """The kernel library as this process loaded it (`pagedserve_kernels.native.NativeLibrary`)."""
    attention = [
        FLAG,  # instruction set
        POINTER, SIZE, SIZE,  # query, its row and head strides
        POINTER, POINTER, FLAG, FLAG,  # k_cache, v_cache, bfloat16, int8 caches
        POINTER, POINTER, POINTER, SIZE,  # rows, context_lens, block_tables, table stride
        SIZE, SIZE, SIZE, SIZE, SIZE,  # seqs, kv heads, group, head_dim, block_size
        ctypes.c_float, SIZE,  # scale, window
        POINTER, SIZE, SIZE,  # out, its row and head strides
    ]  # fmt: skip
    return NativeLibrary.load(
        "pagedserve_kernels._attention_cpu",
        "decode_attention_supported",
        {"decode_attention": attention},
        "decode_attention_isa_supported",
    )


def available() -> bool:
    """Whether the native kernel was built and this CPU runs it (AVX2 and FMA at least)."""
    return _native().available()


def supported_isas() -> tuple[str, ...]:
    """The instruction sets (`pagedserve_kernels.native.VECTOR_ISAS`) this CPU runs the kernel with,
    fastest first."""
    return _native().isas


def best_isa() -> str | None:
    """The fastest instruction set this CPU runs the kernel with (None: none)."""
    return _native().best_isa()


def accepts(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
) -> bool:
    """Whether `decode_attention` takes these operands (else use the torch path).

    `query` / `out` `[tokens, H_q, D]` and the caches `[blocks, block_size, H_kv, D]` (already
    validated against each other) must share a dtype, float32 or bfloat16, on the CPU, with the
    head dimension contiguous; the caches contiguous. Int8 caches (`kv_quant`: codes and a scale
    per vector) go with a float32 or bfloat16 query: the kernel reads their codes in place."""
    head_dim = kv_quant.head_dim_of(k_cache)
    group = query.shape[1] // k_cache.shape[2]
    return (
        available()
        and query.dtype in (torch.float32, torch.bfloat16)
        and query.dtype == out.dtype
        and k_cache.dtype in (query.dtype, torch.int8)
        and k_cache.device.type == "cpu"
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and query.stride(-1) == 1
        and out.stride(-1) == 1
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and group <= MAX_GROUP
    )


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    decodes: DecodeRows,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    isa: str | None = None,
) -> None:
    """Fill `out`'s rows `decodes.rows` with each decode's attention over its paged context
    (its last `sliding_window` keys when given), with instruction set `isa` (one of
    `supported_isas()`; None: the fastest). Operands as `accepts` requires."""
    library = _native().require("the attention CPU kernel is not available (not built, or no AVX2)")
    if not accepts(query, k_cache, v_cache, out):
        raise ValueError("decode_attention: operands the kernel does not take (see accepts)")
    num_seqs = decodes.rows.shape[0]
    if num_seqs == 0:
        return
    _, block_size, num_kv_heads, _ = k_cache.shape
    head_dim = kv_quant.head_dim_of(k_cache)
    status = library.decode_attention(
        _native().isa_number(isa),
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        int(query.dtype == torch.bfloat16),
        int(kv_quant.is_int8(k_cache)),
        decodes.rows.data_ptr(),
        decodes.context_lens.data_ptr(),
        decodes.block_tables.data_ptr(),
        decodes.block_tables.stride(0),
        num_seqs,
        num_kv_heads,
        query.shape[1] // num_kv_heads,
        head_dim,
        block_size,
        scale,
        0 if sliding_window is None else sliding_window,
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
    )
    if status != 0:
        raise RuntimeError(f"decode_attention failed with status {status}")
