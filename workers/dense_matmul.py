"""The product `x W^T` of the linear layers: a oneDNN-prepacked weight, 4-bit codes for decode,
or (opt-in) int8-quantized activations against the 4-bit codes for every other call.

`F.linear` on bfloat16 CPU tensors hands the plain `[out, in]` weight to oneDNN, which reorders
it into its blocked layout on every call: for a decode step that is a second pass over every
weight byte. `DenseMatmul.pack()` does that reorder once (`mkldnn._reorder_linear_weight`) and
calls then run `mkldnn._linear_pointwise` on the packed copy: the same oneDNN kernel, the same
result, one pass. float32 weights are packed the same way (oneDNN's float32 kernel on the packed
copy instead of MKL's sgemm: equal up to float32 summation order; the float32 LM head is
packed as well): in float32 1.5-1.9x faster decode and 1.7-2x faster prefill than sgemm.

Decode batches read every weight for a few rows, so there the product is bound by reading the
weights. A layer whose float32 checkpoint values are exactly GGUF Q4_1 blocks (a model loaded from a
Q4_1 file) is handed those values once (`adopt_exact_source`), and a layer stored as Q4_K its
file's codes (`adopt_block_form`), and keeps them as 4-bit codes
(`pagedserve_kernels.q4_cpu`: 0.75 bytes per weight with its scales, against 2 in bfloat16); calls
of at most `Q4_MAX_ROWS[dtype]` rows (per instruction set: `Q4_MAX_ROWS_BY_ISA`) multiply those.
They compute over the checkpoint's exact float32 weights: in float32 the packed product up to
summation order, in bfloat16 a more exact one than the packed bfloat16 weight gives (the weights are
not rounded, the sums are float32, the result is rounded once), so a bfloat16 model's decode rows
are closer to float32 than its larger batches.

With `quantized_activations` (the model's setting, off by default) such a layer also keeps its
codes in the layout of `pagedserve_kernels.quant_dot_cpu` (as does a layer whose GGUF blocks are
handed over by `adopt_panels`: Q4_0, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K), and every call
quantizes `x` to int8 per row-block of 32 and multiplies with integer dot products: not
float32-exact (docs/quantized_activations.md). Such a layer keeps no 4-bit copy: every call and
the native decoder stack (`workers.decoder_stack`) multiply on the panels.

Invariants: `__call__` returns, in `x`'s dtype, what `F.linear(x, weight, bias)` returns (bitwise
in bfloat16, to float32 rounding in float32), or for a call on the 4-bit copy what
`F.linear(x.float(), source, bias)` returns rounded to `x`'s dtype (to float32 rounding, the
bias added in `x`'s dtype), or with panels `quant_dot_cpu.quant_matmul(x, ...)` (within its
stated bound of that product); the packed copy is a snapshot taken by the last
`pack()`, so whoever changes the weight in place afterwards must call `pack()` again (the model
packs once, at the end of its `load`); `pack()` keeps the 4-bit copy and the panels only while
they still round to the weight, bit for bit. Only bfloat16 (with oneDNN bfloat16 support) and
float32 CPU weights are packed, and only inputs of the weight's dtype use the packed copy;
everything else takes `F.linear`. The plain weight stays where it is (loading, tensor-parallel
slicing and any later per-layer step, e.g. an adapter added after the base product, keep reading
it).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F

from pagedserve_kernels import q4_cpu, quant_dot_cpu
from pagedserve_kernels.gguf_panels import BlockForm

PACK_BATCH_HINT = 16
"""The batch size oneDNN is told to expect when it picks the packed layout (decode batches)."""

Q4_MAX_ROWS_BY_ISA: Mapping[str, Mapping[torch.dtype, int]] = MappingProxyType(
    {
        "avx512": MappingProxyType({torch.bfloat16: 8, torch.float32: 16}),
        "avx2": MappingProxyType({torch.bfloat16: 32, torch.float32: 16}),
    }
)
"""Per instruction set of the 4-bit kernel (`pagedserve_kernels.q4_cpu.best_isa()`) and input dtype,
the most rows a call may have to use the 4-bit copy: where it beats the packed weight
(with AVX-512: bfloat16 1.2-1.6x at 1-8 rows, 0.9x at 12; float32 1.2-3.4x at 1-16, level at 32;
with AVX2, where oneDNN only emulates bfloat16, the kernel still wins at 32 bfloat16 rows)."""

Q4_MAX_ROWS: Mapping[torch.dtype, int] = Q4_MAX_ROWS_BY_ISA[q4_cpu.best_isa() or "avx512"]
"""`Q4_MAX_ROWS_BY_ISA` for the instruction set the 4-bit kernel runs with on this CPU."""


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
        self.q4: q4_cpu.Q4Weight | None = None
        self.quantized_decode = True
        """Whether `adopt_exact_source` may keep a 4-bit copy (the model's setting)."""
        self.panels: quant_dot_cpu.PanelWeight | None = None
        self.quantized_activations = False
        """Whether `adopt_exact_source` may keep the codes for int8-activation products (the
        model's setting; not float32-exact)."""

    def adopt_exact_source(self, *row_blocks: torch.Tensor) -> None:
        """Keep the float32 values the weight was loaded from (its rows, in one or more
        consecutive blocks: a fused layer's checkpoint tensors) as 4-bit codes if they are
        exactly Q4_1 blocks and the kernel runs here (with `quantized_activations`, as
        `quant_dot_cpu` panels instead, where that kernel runs); otherwise keep nothing. The
        blocks are stacked only when a copy can be kept, so other models pay no copy at load."""
        self.q4, self.panels = None, None
        keep_q4 = self._usable() and self.quantized_decode and q4_cpu.available()
        keep_panels = self.wants_panels()
        if not (keep_q4 or keep_panels):
            return
        if sum(block.shape[0] for block in row_blocks) != self.weight.shape[0]:
            return
        source = row_blocks[0] if len(row_blocks) == 1 else torch.cat(row_blocks)
        exact = q4_cpu.Q4Weight.recover(source) if source.shape == self.weight.shape else None
        if exact is not None:
            self.panels = quant_dot_cpu.PanelWeight.from_q4(exact) if keep_panels else None
            self.q4 = exact if keep_q4 and self.panels is None else None

    def _usable(self) -> bool:
        return self.weight.device.type == "cpu" and self.weight.dtype in Q4_MAX_ROWS

    def wants_panels(self) -> bool:
        """Whether this layer would keep panels (`quantized_activations`, a CPU float weight,
        the kernel runs here) and has none yet."""
        keep = self._usable() and self.quantized_activations and quant_dot_cpu.available()
        return keep and self.panels is None

    def wants_block_form(self) -> bool:
        """Whether this layer would keep its stored block codes: as panels (`wants_panels()`),
        or, without `quantized_activations`, as the 4-bit copy where the values gave none
        (GGUF Q4_K, whose per-block scales and minimums are not Q4_1's: `Q4Weight.recover`
        cannot find them, the file's codes are that form exactly)."""
        keep_q4 = self._usable() and self.quantized_decode and q4_cpu.available()
        return self.wants_panels() or (keep_q4 and self.q4 is None and self.panels is None)

    def adopt_block_form(self, form: BlockForm | None) -> None:
        """Keep the weight's stored block codes (a GGUF file's, `pagedserve_kernels.gguf_panels`)
        as panels where `wants_panels()`, else, where `wants_block_form()` and they are 4-bit,
        as the 4-bit copy; `pack()` drops either unless it dequantizes to the weight bit for
        bit."""
        if form is None or form.codes.shape != self.weight.shape:
            return
        if self.wants_panels():
            self.panels = form.panels()
        elif self.wants_block_form() and form.bits == 4:
            self.q4 = q4_cpu.Q4Weight.from_codes(form.codes, form.scales, form.mins)

    def pack(self) -> None:
        """Snapshot the weight into oneDNN's layout (a no-op where `can_pack` is false), and drop
        the 4-bit copies that no longer round to the weight."""
        self.packed = None
        if can_pack(self.weight):
            weight = self.weight.detach().contiguous()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        form = self.q4 if self.q4 is not None else self.panels  # both hold the same weights
        if form is not None:
            rounded = form.dequantize().to(self.weight.dtype)
            if not torch.equal(rounded, self.weight.detach()):
                self.q4, self.panels = None, None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, bias)
        if self.panels is not None:  # faster than every other product at every batch size
            y = quant_dot_cpu.quant_matmul(x, self.panels)
            return y if bias is None else y + bias
        if self.q4 is not None and x.numel() <= Q4_MAX_ROWS.get(x.dtype, 0) * x.shape[-1]:
            y = q4_cpu.q4_matmul(x, self.q4)
            return y if bias is None else y + bias
        if self.packed is None:
            return F.linear(x, self.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")
