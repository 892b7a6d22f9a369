"""Building blocks: RMSNorm and the tensor-parallel linear, embedding and LM-head layers.

Each parallel layer knows which rows (column-parallel) or columns (row-parallel) of the full
checkpoint tensor its rank owns and loads exactly those through a `CheckpointReader`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F

from pagedserve_kernels import q8_cpu, quant_dot_cpu
from pagedserve_kernels.gguf_panels import stack_forms
from pagedserve_kernels.q8_cpu import Q8Weight
from pagedserve_kernels.quant_dot_cpu import PanelWeight
from workers.checkpoint import CheckpointReader
from workers.dense_matmul import DenseMatmul
from workers.int8_head import Int8ScreenedHead
from workers.lm_head import ScreenedHead
from workers.parallel import TensorParallel, even_range


class RMSNorm(torch.nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalized in float32 (replicated on every rank).

    `offset` is added to the checkpoint's weight at load (Gemma stores `w` for `1 + w`)."""

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, offset: float = 0.0
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The result is in the weight's dtype, whatever `x`'s (a float32 residual stream feeds
        bfloat16 layers through here)."""
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(self.weight.dtype)

    def load(self, reader: CheckpointReader, name: str) -> None:
        weight = reader.read(name, tuple(self.weight.shape))
        self.weight.copy_(weight + self.offset if self.offset else weight)


@dataclass(frozen=True)
class RowSegment:
    """Rows `[start, stop)` of checkpoint tensor `<prefix><name>` (full row count `full_rows`)."""

    name: str
    full_rows: int
    start: int
    stop: int


class ColumnParallelLinear(torch.nn.Module):
    """y = x W^T (+ b) where W stacks this rank's row segments of one or more checkpoint tensors.

    Fusing (q, k, v) or (gate, up) into one matmul is a matter of listing several segments.
    The output stays sharded (no collective). The product runs through `self.matmul` (a
    `DenseMatmul` over `self.weight`, packed by the model once loaded).
    """

    def __init__(
        self, input_size: int, segments: list[RowSegment], bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.segments = segments
        rows = sum(segment.stop - segment.start for segment in segments)
        self.weight = torch.nn.Parameter(
            torch.zeros(rows, input_size, dtype=dtype), requires_grad=False
        )
        self.bias = (
            torch.nn.Parameter(torch.zeros(rows, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self.matmul = DenseMatmul(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        row = 0
        sources = []
        for segment in self.segments:
            count = segment.stop - segment.start
            weight = reader.read(
                f"{prefix}{segment.name}.weight",
                (segment.full_rows, self.input_size),
                0,
                segment.start,
                segment.stop,
            )
            self.weight[row : row + count].copy_(weight)
            sources.append(weight)
            if self.bias is not None:
                bias = reader.read(
                    f"{prefix}{segment.name}.bias",
                    (segment.full_rows,),
                    0,
                    segment.start,
                    segment.stop,
                )
                self.bias[row : row + count].copy_(bias)
            row += count
        self.matmul.adopt_exact_source(*sources)
        if self.matmul.wants_block_form():  # not recovered from the values: the file's codes
            forms = [
                reader.block_form(f"{prefix}{segment.name}.weight", 0, segment.start, segment.stop)
                for segment in self.segments
            ]
            held = [form for form in forms if form is not None]
            if len(held) == len(forms):
                self.matmul.adopt_block_form(stack_forms(held))


class RowParallelLinear(torch.nn.Module):
    """y = all_reduce(x_shard W_shard^T) (+ b): this rank owns input columns `[start, stop)`.

    The local product runs through `self.matmul` (see `ColumnParallelLinear`)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        columns: tuple[int, int],
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.columns = columns
        self.tp = tp
        width = columns[1] - columns[0]
        self.weight = torch.nn.Parameter(
            torch.zeros(output_size, width, dtype=dtype), requires_grad=False
        )
        self.bias = (
            torch.nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self.matmul = DenseMatmul(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias

    def load(self, reader: CheckpointReader, name: str) -> None:
        start, stop = self.columns
        full = (self.output_size, self.input_size)
        weight = reader.read(f"{name}.weight", full, 1, start, stop)
        self.weight.copy_(weight)
        self.matmul.adopt_exact_source(weight)
        if self.matmul.wants_block_form():
            self.matmul.adopt_block_form(reader.block_form(f"{name}.weight", 1, start, stop))
        if self.bias is not None:
            self.bias.copy_(reader.read(f"{name}.bias", (self.output_size,)))


Q8_MAX_ROWS_BY_ISA: Mapping[str, int] = MappingProxyType({"avx512": 4, "avx2": 8})
"""Per instruction set of the 8-bit kernel, the most rows an LM head multiplies on its 8-bit
copy: there a decode step reads its weights from memory, and the kernel reads less than the
screened bfloat16 or packed float32 head; more rows are bound by its float32 arithmetic, where
oneDNN's product wins (with AVX-512 at 8 rows; with AVX2, where oneDNN only emulates bfloat16,
the kernel is 1.3-1.8x the packed float32 head at 1-8 rows, level at 16)."""

Q8_MAX_ROWS: int = Q8_MAX_ROWS_BY_ISA[q8_cpu.best_isa() or "avx512"]
"""`Q8_MAX_ROWS_BY_ISA` for the instruction set the 8-bit kernel runs with on this CPU."""


class VocabParallelEmbedding(torch.nn.Module):
    """Rank r owns vocab rows `[start, stop)` (padded to an equal count per rank).

    `embed` looks up its own rows, zeroes the others, and all-reduces; `logits` (the LM head,
    sharing or not the embedding weight) computes its rows' logits and all-gathers, trimmed to
    `vocab_size`.

    With `screened` (a float32 LM head of a reduced-precision model), `load` also builds a
    `ScreenedHead` and `logits` computes through it: bfloat16 speed, float32 top logits.
    Otherwise `logits` runs `head_matmul` (a `DenseMatmul`, which the model packs for its LM
    head only, so an embedding that is not the head keeps one copy of its weight).

    `keep_exact_q8` (the model calls it for its head): where the float32 weight is exactly GGUF
    Q8_0 blocks and the CPU kernel runs, `logits` of at most `Q8_MAX_ROWS` rows multiply those
    8-bit codes instead (`pagedserve_kernels.q8_cpu`): every logit is the float32 product over the
    exact weights (up to summation order), read at 1.125 bytes per weight. With `activations` (the
    model's `quantized_activations`) larger batches multiply the same codes with int8-quantized
    hidden rows and recompute in float32 the logits that could be a row's maximum
    (`workers.int8_head`): the greedy choice stays the float32 head's.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TensorParallel,
        dtype: torch.dtype,
        screened: bool = False,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tp = tp
        self.start, self.stop = even_range(vocab_size, tp)
        rows_per_rank = -(-vocab_size // tp.world_size)
        self.weight = torch.nn.Parameter(
            torch.zeros(rows_per_rank, hidden_size, dtype=dtype), requires_grad=False
        )
        self.screened = screened
        self.screen: ScreenedHead | None = None
        self.q8: Q8Weight | None = None
        self.int8_head: Int8ScreenedHead | None = None
        self.head_matmul = DenseMatmul(self.weight)  # packed by the model when it is the head

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(token_ids, self.weight)
        owned = (token_ids >= self.start) & (token_ids < self.stop)
        local = torch.where(owned, token_ids - self.start, torch.zeros_like(token_ids))
        vectors = F.embedding(local, self.weight) * owned[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(vectors)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.q8 is not None and hidden.shape[0] <= Q8_MAX_ROWS:
            local = q8_cpu.q8_matmul(hidden.to(torch.float32), self.q8)  # all of its rows
        elif self.int8_head is not None:
            local = self.int8_head.logits(hidden)
        elif self.screen is None:
            local = self.head_matmul(hidden)
        else:
            local = self.screen.logits(hidden)
            if local.shape[1] < self.weight.shape[0]:  # this rank's padding rows: zero logits
                local = F.pad(local, (0, self.weight.shape[0] - local.shape[1]))
        return self.tp.all_gather_last_dim(local)[..., : self.vocab_size]

    def load(self, reader: CheckpointReader, name: str) -> None:
        rows = self.stop - self.start
        weight = reader.read(name, (self.vocab_size, self.hidden_size), 0, self.start, self.stop)
        self.weight[:rows].copy_(weight)
        if self.screened:
            self.screen = ScreenedHead.of(self.weight[:rows])

    def keep_exact_q8(self, decode: bool = True, activations: bool = False) -> None:
        """Keep the head's weight as Q8_0 codes where it is exactly that form, on one CPU rank:
        for `decode` the float32 kernel's copy, for `activations` the int8-activation panels
        (where each kernel is built; else keep nothing; see the class doc)."""
        self.q8, self.int8_head = None, None
        weight = self.weight
        usable = self.tp.world_size == 1 and weight.device.type == "cpu"
        keep_q8 = decode and q8_cpu.available()
        keep_panels = activations and quant_dot_cpu.available()
        if usable and weight.dtype == torch.float32 and (keep_q8 or keep_panels):
            exact = Q8Weight.recover(weight.detach())
            if exact is not None:
                self.q8 = exact if keep_q8 else None
                if keep_panels:
                    panels = PanelWeight.from_q8(exact)
                    self.int8_head = Int8ScreenedHead.of(weight.detach(), panels)
