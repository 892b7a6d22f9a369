"""Non-paged attention for the `contiguous` and `virtual` KV layouts.

There a sequence's KV occupies one contiguous run of blocks starting at `first_blocks[s]`, so its
keys are a plain view of the cache, `k_cache[first : first + n].flatten(0, 1)[:context_len]`: no
block table, no gather. Each sequence attends with one `scaled_dot_product_attention` call (GQA by
`enable_gqa`, causal by an explicit mask over its chunk, sliding window honoured).

`RangeAttention` is this layout's step metadata: it satisfies `pagedserve_kernels.AttentionStep`
like the paged `PagedAttentionStep`, so the model calls `step.attend(...)` without asking which it
holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve_kernels.metadata import PreparedAttention
from pagedserve_kernels.torch_cpu import capped_attention


@dataclass(frozen=True)
class RangeAttention:
    """One step's validated kernel metadata (KV writes go through it as in the paged layout)
    plus each sequence's first block; `attend` runs `range_attention` over them."""

    prepared: PreparedAttention
    first_blocks: list[int]

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of this step's packed queries over each sequence's contiguous run."""
        prepared = self.prepared
        return range_attention(
            query,
            k_cache,
            v_cache,
            query_starts=prepared.query_starts,
            query_lens=prepared.query_lens,
            context_lens=prepared.context_lens,
            first_blocks=self.first_blocks,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
        )


def contiguous_runs(tables: list[list[int]]) -> list[int]:
    """The first block of each table, which must be one run `first, first + 1, ...`."""
    firsts: list[int] = []
    for index, table in enumerate(tables):
        first = table[0] if table else 0
        if table != list(range(first, first + len(table))):
            raise ValueError(
                f"sequence {index} of the batch has a block table that is not one contiguous "
                f"run ({table[:8]}...); the contiguous and virtual layouts need one"
            )
        firsts.append(first)
    return firsts


def range_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    query_starts: Sequence[int],
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    first_blocks: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries `[tokens, H_q, D]` over contiguous per-sequence KV.

    Caches are `[num_blocks, block_size, H_kv, D]`; sequence s has `query_lens[s]` query rows
    from `query_starts[s]`, and its query token j sits at position `context_len - q_len + j` and
    sees positions up to its own (and above its position minus `sliding_window`); `softcap`
    caps the scaled scores as `pagedserve_kernels.paged_attention` does. Returns `[tokens, H_q, D]`
    in the query's dtype.
    """
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    for start, q_len, context, first in zip(
        query_starts, query_lens, context_lens, first_blocks, strict=True
    ):
        if q_len == 0:
            continue
        blocks = -(-context // block_size)
        keys = k_cache[first : first + blocks].flatten(0, 1)[:context]
        values = v_cache[first : first + blocks].flatten(0, 1)[:context]
        first_key = 0
        if sliding_window is not None:
            first_key = max(0, context - q_len - sliding_window + 1)
            keys, values = keys[first_key:], values[first_key:]
        mask = None
        if q_len > 1 or first_key > 0:
            positions = torch.arange(context - q_len, context, device=query.device)[:, None]
            key_positions = torch.arange(first_key, context, device=query.device)[None, :]
            mask = key_positions <= positions
            if sliding_window is not None:
                mask &= key_positions > positions - sliding_window
        queries = query[start : start + q_len].transpose(0, 1).unsqueeze(0)
        if softcap is not None:  # SDPA has no soft cap: the explicit float32 computation
            group = query.shape[1] // k_cache.shape[2]
            attended = capped_attention(
                queries,
                keys.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0),
                values.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0),
                mask,
                scale,
                softcap,
            )
        else:
            attended = F.scaled_dot_product_attention(
                queries,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
        out[start : start + q_len] = attended[0].transpose(0, 1)
    return out
