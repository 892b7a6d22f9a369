"""Which part of an adapter a tensor-parallel rank holds: its slice of every LoRA pair.

LoRA follows the base layer it adapts (see `workers.parallel` and `workers.model`):
- column-parallel projections (q, k, v, gate, up) keep A whole and split B's output rows exactly
  like the base weight's rows (query heads, KV heads, possibly replicated, MLP columns);
- row-parallel projections (o, down) split A's input columns like the base weight's columns and
  keep B whole; the rank-`r` intermediate `A x` is all-reduced before B is applied, which equals
  the single-rank result because B is linear.

The projections are grouped as the model fuses them: `qkv`, `o`, `gate_up`, `down`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.config import ModelSpec
from workers.lora.peft_format import AdapterWeights
from workers.parallel import TensorParallel, even_range, head_layout


@dataclass(frozen=True)
class TargetLayout:
    """One fused target on one rank: its projections, each one's output rows `[start, stop)` of
    the full weight (column-parallel) and the input columns `[start, stop)` (row-parallel)."""

    name: str
    projections: tuple[str, ...]
    row_spans: tuple[tuple[int, int], ...]
    input_span: tuple[int, int]
    input_size: int
    """The full input width (before any split)."""
    output_size: int
    """The full output width of each projection (row-parallel: the hidden size)."""
    row_parallel: bool

    @property
    def widths(self) -> tuple[int, ...]:
        """Local output width of each projection, in order (they are concatenated)."""
        return tuple(stop - start for start, stop in self.row_spans)

    @property
    def local_inputs(self) -> int:
        return self.input_span[1] - self.input_span[0]


def target_layouts(spec: ModelSpec, tp: TensorParallel) -> tuple[TargetLayout, ...]:
    """The four fused targets of a decoder layer on rank `tp.rank`."""
    layout = head_layout(spec, tp)
    d = spec.head_dim
    q_span = (layout.q_start * d, (layout.q_start + layout.num_q) * d)
    kv_span = (layout.kv_start * d, (layout.kv_start + layout.num_kv) * d)
    mlp_span = even_range(spec.intermediate_size, tp)
    hidden = spec.hidden_size
    whole_hidden = (0, hidden)
    return (
        TargetLayout(
            "qkv", ("q_proj", "k_proj", "v_proj"), (q_span, kv_span, kv_span), whole_hidden,
            hidden, 0, False,
        ),
        TargetLayout(
            "o", ("o_proj",), (whole_hidden,), q_span, spec.num_heads * d, hidden, True
        ),
        TargetLayout(
            "gate_up", ("gate_proj", "up_proj"), (mlp_span, mlp_span), whole_hidden, hidden, 0,
            False,
        ),
        TargetLayout(
            "down", ("down_proj",), (whole_hidden,), mlp_span, spec.intermediate_size, hidden,
            True,
        ),
    )  # fmt: skip


@dataclass(frozen=True)
class AdapterShard:
    """One rank's slice of an adapter: (layer, projection) -> (A `[r, in_local]`, B
    `[out_local, r]` with the scaling folded in), float32 on the CPU."""

    digest: str
    rank: int
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


def shard_adapter(weights: AdapterWeights, spec: ModelSpec, tp: TensorParallel) -> AdapterShard:
    """Rank `tp.rank`'s slice of `weights` (see the module docstring for the split)."""
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for target in target_layouts(spec, tp):
        for projection, (row_start, row_stop) in zip(
            target.projections, target.row_spans, strict=True
        ):
            for layer in range(spec.num_layers):
                pair = weights.pairs.get((layer, projection))
                if pair is None:
                    continue
                col_start, col_stop = target.input_span
                a = pair.a[:, col_start:col_stop].contiguous()
                b = (pair.b[row_start:row_stop] * weights.scaling).contiguous()
                pairs[(layer, projection)] = (a, b)
    return AdapterShard(weights.digest, weights.rank, pairs)
