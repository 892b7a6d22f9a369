"""Partial rotary embeddings by reordering each query and key head's dimensions at load.

A head of `D` dimensions whose first `R` rotate (rotate-half pairs `(i, i + R/2)`) is stored
reordered as `[rot[:R/2], pass[:P], rot[R/2:], pass[P:]]` with `P = (D - R) / 2`. The rotated
pairs are then `(j, j + D/2)`, Llama's full-head rotation, and the pass dimensions sit where
`RotaryEmbedding` gives cos 1 and sin 0. Queries and keys are reordered alike, so their dot
products, and with them the attention, are unchanged; values and `o_proj` are untouched. The
KV cache holds the reordered keys, which no one reads but the attention.
"""

from __future__ import annotations

import torch

from workers.checkpoint import CheckpointReader
from workers.config import ModelSpec

QUERY_KEY_SUFFIXES = (
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
)


def head_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Checkpoint dimension of each stored dimension of a head (see the module doc)."""
    half_rot, passing = rotary_dim // 2, (head_dim - rotary_dim) // 2
    rot = torch.arange(rotary_dim)
    rest = torch.arange(rotary_dim, head_dim)
    return torch.cat((rot[:half_rot], rest[:passing], rot[half_rot:], rest[passing:]))


class PartialRotaryView:
    """A `CheckpointReader` whose query and key rows come reordered within each head; every
    other tensor is read as stored. Reads of those rows must cover whole heads (they do: ranks
    own whole heads)."""

    def __init__(self, reader: CheckpointReader, spec: ModelSpec) -> None:
        self.reader = reader
        self.head_dim = spec.head_dim
        self.order = head_order(spec.head_dim, spec.rope.rotary_dim(spec.head_dim))

    def block_form(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> None:
        """No stored block codes through this view: its layers keep their dense products."""
        return None

    def read(
        self,
        name: str,
        expected_shape: tuple[int, ...],
        dim: int = 0,
        start: int = 0,
        stop: int | None = None,
    ) -> torch.Tensor:
        tensor = self.reader.read(name, expected_shape, dim, start, stop)
        if not name.endswith(QUERY_KEY_SUFFIXES) or dim != 0:
            return tensor
        rows = tensor.shape[0]
        if start % self.head_dim or rows % self.head_dim:
            raise ValueError(f"weight {name!r}: a partial rotary needs whole heads per rank")
        heads = tensor.reshape(rows // self.head_dim, self.head_dim, *tensor.shape[1:])
        return heads[:, self.order].reshape(tensor.shape)


def partial_rotary_view(reader: CheckpointReader, spec: ModelSpec) -> CheckpointReader:
    """`reader` itself for a full rotary, else its `PartialRotaryView`."""
    if spec.rope.rotary_dim(spec.head_dim) == spec.head_dim:
        return reader
    return PartialRotaryView(reader, spec)  # type: ignore[return-value]
