"""Builders of paged-attention test batches with deliberately awkward block tables.

Every cache is filled with random values everywhere (unused blocks too), and each sequence's blocks
are a shuffled, non-contiguous draw from the pool, so reading the wrong block cannot go unnoticed.
Block-table rows are padded with -1 past a sequence's blocks, plus one spare column.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

KINDS = ("prefill", "decode", "mixed")

TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


@dataclass(frozen=True)
class AttentionCase:
    """Arguments of one paged_attention call, on the CPU."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float

    def kwargs(self) -> dict[str, torch.Tensor | float]:
        return {
            "cu_query_lens": self.cu_query_lens,
            "context_lens": self.context_lens,
            "block_tables": self.block_tables,
            "scale": self.scale,
        }

    def to(self, device: torch.device | str) -> AttentionCase:
        return AttentionCase(
            self.query.to(device),
            self.k_cache.to(device),
            self.v_cache.to(device),
            self.cu_query_lens.to(device),
            self.context_lens.to(device),
            self.block_tables.to(device),
            self.scale,
        )


def lengths_for(kind: str, block_size: int) -> list[tuple[int, int]]:
    """(context_len, query_len) per sequence; contexts end on a block boundary and one past it.

    prefill: a whole prompt on a boundary, one a token past it, and a chunk continuing after a
    cached prefix. decode: one query token each. mixed: both, plus an idle sequence (0 queries).
    """
    bs = block_size
    if kind == "prefill":
        return [(2 * bs, 2 * bs), (bs + 1, bs + 1), (2 * bs + 1, bs // 2 + 1)]
    if kind == "decode":
        return [(bs, 1), (bs + 1, 1), (3 * bs, 1), (1, 1)]
    if kind == "mixed":
        return [(2 * bs + 1, 2 * bs + 1), (bs, 1), (bs + 1, 1), (3 * bs, bs // 2), (bs, 0)]
    raise ValueError(f"unknown batch kind {kind!r}")


def make_case(
    lengths: list[tuple[int, int]],
    *,
    block_size: int,
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    num_kv_heads: int = 2,
    spare_blocks: int = 3,
    seed: int = 0,
) -> AttentionCase:
    """A batch over one shuffled pool with ``spare_blocks`` blocks no sequence owns."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in lengths]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator)
    max_blocks = max(blocks_per_seq, default=0) + 1
    tables = torch.full((len(lengths), max_blocks), -1, dtype=torch.int32)
    used = 0
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = order[used : used + count].to(torch.int32)
        used += count
    q_lens = torch.tensor([q for _, q in lengths], dtype=torch.int32)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(q_lens, 0)
    num_tokens = int(cu[-1])
    query = torch.randn((num_tokens, num_kv_heads * group, head_dim), generator=generator)
    return AttentionCase(
        query=query.to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        cu_query_lens=cu,
        context_lens=torch.tensor([c for c, _ in lengths], dtype=torch.int32),
        block_tables=tables,
        scale=head_dim**-0.5,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Outputs agree within the dtype's tolerance (absolute and relative)."""
    tol = TOLERANCE[dtype]
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


BLOCK_SIZES = (8, 16, 32)
HEAD_DIMS = (64, 128)
GROUPS = (1, 3, 4)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def covering_grid() -> list[tuple[int, str, int, int, torch.dtype]]:
    """(block_size, kind, group, head_dim, dtype): every block size x kind x group, with head dims
    and dtypes cycled so that each appears with every block size and every kind."""
    grid = []
    index = 0
    for block_size in BLOCK_SIZES:
        for kind in KINDS:
            for group in GROUPS:
                head_dim = HEAD_DIMS[index % len(HEAD_DIMS)]
                dtype = DTYPES[(index + index // len(GROUPS)) % len(DTYPES)]
                grid.append((block_size, kind, group, head_dim, dtype))
                index += 1
    return grid


def grid_id(params: tuple[int, str, int, int, torch.dtype]) -> str:
    block_size, kind, group, head_dim, dtype = params
    return f"bs{block_size}-{kind}-g{group}-d{head_dim}-{str(dtype).removeprefix('torch.')}"


def triton_device() -> str:
    """Where Triton kernels run in this session: the CPU under its interpreter, else CUDA."""
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
