"""Tensor-parallel layout: which heads, KV heads, MLP columns and vocab rows a rank owns.

`TensorParallel` is the only place the model learns about ranks: its linear layers ask it for
their row/column ranges and call its collectives. With `world_size == 1` the collectives are
no-ops, so a single rank needs no process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.config import ModelSpec


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `world_size`; collectives run on torch.distributed's default group."""

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False
    """Mixture-of-experts layers place whole experts per rank (`workers.moe`)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (identity on one rank)."""
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` along the last dimension (rank order)."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class HeadLayout:
    """The attention heads of one rank: query heads `[q_start, q_start + num_q)` and KV heads
    `[kv_start, kv_start + num_kv)` of the full model.

    Invariant: every local query head's KV head (full index `q // (H_q / H_kv)`) is local. When
    there are fewer KV heads than ranks, each rank holds the one KV head its query heads use
    (KV heads are replicated across ranks).
    """

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def check_tensor_parallel(spec: ModelSpec, world_size: int, expert_parallel: bool = False) -> None:
    """Raise a ValueError naming the problem when `world_size` cannot split this model: the
    count at fault, the model's query and KV head counts, and the degrees that split all of
    it (heads, KV heads, MLP columns, and the experts or each expert's columns)."""
    experts = spec.variant.num_experts
    if expert_parallel and experts == 0:
        raise ValueError(
            "enable_expert_parallel needs a mixture-of-experts model; this one is dense "
            f"({spec.architecture})"
        )
    fitting = [n for n in range(1, spec.num_heads + 1) if _splits(spec, n, expert_parallel)]
    heads = f"(the model has {spec.num_heads} attention heads and {spec.num_kv_heads} KV heads"
    hint = f"; tensor_parallel_size may be one of {fitting})"
    if expert_parallel and experts % world_size:
        raise ValueError(
            f"enable_expert_parallel: tensor_parallel_size {world_size} does not divide the "
            f"model's {experts} experts {heads}{hint}"
        )
    width = spec.variant.expert_intermediate_size
    if experts and not expert_parallel and width and width % world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide the model's expert "
            f"intermediate size {width} {heads}{hint}; or pass enable_expert_parallel"
        )
    if spec.num_heads % world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide the model's "
            f"{spec.num_heads} attention heads {heads}{hint}"
        )
    kv = spec.num_kv_heads
    if kv >= world_size and kv % world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide the model's {kv} KV heads "
            f"{heads}{hint}"
        )
    if kv < world_size and world_size % kv:
        raise ValueError(
            f"tensor_parallel_size {world_size} is not a multiple of the model's {kv} KV heads "
            f"(needed to replicate them) {heads}{hint}"
        )
    if spec.intermediate_size % world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide the model's intermediate size "
            f"{spec.intermediate_size} {heads}{hint}"
        )


def _splits(spec: ModelSpec, world_size: int, expert_parallel: bool = False) -> bool:
    kv = spec.num_kv_heads
    experts = spec.variant.num_experts
    width = spec.variant.expert_intermediate_size
    if experts and expert_parallel:
        experts_split = experts % world_size == 0
    else:
        experts_split = not (experts and width) or width % world_size == 0
    return (
        spec.num_heads % world_size == 0
        and (kv % world_size == 0 if kv >= world_size else world_size % kv == 0)
        and spec.intermediate_size % world_size == 0
        and experts_split
    )


def head_layout(spec: ModelSpec, tp: TensorParallel) -> HeadLayout:
    check_tensor_parallel(spec, tp.world_size)
    num_q = spec.num_heads // tp.world_size
    q_start = tp.rank * num_q
    if spec.num_kv_heads >= tp.world_size:
        num_kv = spec.num_kv_heads // tp.world_size
        return HeadLayout(q_start, num_q, tp.rank * num_kv, num_kv)
    group = spec.num_heads // spec.num_kv_heads
    return HeadLayout(q_start, num_q, q_start // group, 1)


def even_range(total: int, tp: TensorParallel) -> tuple[int, int]:
    """Rank's `[start, stop)` of `total` items split evenly (the last ranks may be shorter)."""
    per_rank = -(-total // tp.world_size)
    start = min(total, tp.rank * per_rank)
    return start, min(total, start + per_rank)
