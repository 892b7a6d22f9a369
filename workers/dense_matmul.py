"""The dense product `x W^T` of the linear layers, over a oneDNN-prepacked weight.

`F.linear` on bfloat16 CPU tensors hands the plain `[out, in]` weight to oneDNN, which reorders
it into its blocked layout on every call: for a decode step that is a second pass over every
weight byte. `DenseMatmul.pack()` does that reorder once (`mkldnn._reorder_linear_weight`) and
calls then run `mkldnn._linear_pointwise` on the packed copy: the same oneDNN kernel, the same
result, one pass. float32 weights are packed the same way (oneDNN's float32 kernel on the packed
copy instead of MKL's sgemm: equal up to float32 summation order; with the float32 LM head
packed as well, 1.5-1.9x decode and 1.7-2x prefill for SmolLM2 here). Measured side by side:
benchmarks/README.md, Round 3.

Invariants: `__call__` returns what `F.linear(x, weight, bias)` returns, in `x`'s dtype (bitwise
in bfloat16, to float32 rounding in float32); the packed copy is a snapshot taken by the last
`pack()`, so whoever changes the weight in place afterwards must call `pack()` again (the model
packs once, at the end of its `load`). Only bfloat16 (with oneDNN bfloat16 support) and float32
CPU weights are packed, and only inputs of the weight's dtype use the packed copy; everything
else takes `F.linear`. The plain weight stays where it is (loading, tensor-parallel slicing and
any later per-layer step, e.g. an adapter added after the base product, keep reading it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 16
"""The batch size oneDNN is told to expect when it picks the packed layout (decode batches)."""


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` is a 2-d bfloat16 or float32 CPU tensor this torch build can prepack for
    oneDNN."""
    if weight.dim() != 2 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class DenseMatmul:
    """`x W^T (+ bias)` for one weight; `pack()` after the weight's values are final."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Snapshot the weight into oneDNN's layout (a no-op where `can_pack` is false)."""
        self.packed = None
        if can_pack(self.weight):
            weight = self.weight.detach().contiguous()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is None or x.dtype != self.weight.dtype or x.device.type != "cpu":
            return F.linear(x, self.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")
