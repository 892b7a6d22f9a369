"""The LM head with int8-quantized activations (`quantized_activations`): screened by the int8
product, float32 where it could matter.

A GGUF Q8_0 head multiplied with int8 hidden rows (`pagedserve_kernels.quant_dot_cpu`) is fast but
moves each logit by up to `sum over blocks of (d / 2) * sum |w|` (d: the block's activation scale),
which flips greedy choices. `Int8ScreenedHead` bounds that error per (row, chunk of `CHUNK`
vocabulary rows) and recomputes in float32 every logit whose upper bound reaches its row's best
lower bound (`workers.lm_head.refine_near_maxima`, as the bfloat16 mode's screened head), so a
row's greedy choice is the float32 head's, given the same hidden row.

Invariants (finite inputs): every logit that could be its row's maximum is the float32 product
`F.linear(h, W[columns])`; every other logit is the int8 estimate (or a float32 value), within
its bound and below the row's maximum.

The bound: an activation is within (d / 2)(1 + 2^-13) of its grid point (the float32 rounding of
x * (1 / d) included), so a logit is within `sum_b (d_b / 2)(1 + 2^-13) mass[n, b]` of the exact
product over the same weights, `mass[n, b]` the block's sum of |w|; per chunk the largest mass
bounds every row of the chunk (one `[rows, blocks] x [blocks, chunks]` product). The kernel's
and the reference's float32 sums add at most `K * 2^-21 * |h| . colmax(|W|)`, and the bound's own
float32 arithmetic is covered by inflating it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve_kernels import quant_dot_cpu
from pagedserve_kernels.quant_dot_cpu import PanelWeight
from workers.lm_head import ABSOLUTE_SLACK, CHUNK, refine_near_maxima

BLOCK = 32


@dataclass(frozen=True)
class Int8ScreenedHead:
    """A float32 LM-head weight `[vocab, hidden]` (by reference) with its int8-product panels,
    `block_mass` `[chunks, hidden / 32]` (per chunk the largest block sum of |w|) and
    `column_max` `[chunks, hidden]` (per chunk the largest |w| of each column), both inflated
    slightly so they stay upper bounds after float32 rounding."""

    weight: torch.Tensor
    panels: PanelWeight
    block_mass: torch.Tensor
    column_max: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor, panels: PanelWeight) -> Int8ScreenedHead:
        rows, hidden = weight.shape
        if panels.shape != (rows, hidden):
            raise ValueError(f"panels {panels.shape} do not hold weight {tuple(weight.shape)}")
        padded = -(-rows // CHUNK) * CHUNK
        magnitude = torch.zeros(padded, hidden, dtype=torch.float32)
        magnitude[:rows] = weight.abs()
        by_chunk = magnitude.view(-1, CHUNK, hidden)
        mass = by_chunk.view(-1, CHUNK, hidden // BLOCK, BLOCK).sum(-1).amax(1)
        return cls(weight, panels, mass * (1 + 2.0**-16), by_chunk.amax(1) * (1 + 2.0**-20))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[rows, vocab]` of `hidden` `[rows, hidden]` (see the invariants)."""
        hidden = hidden.to(torch.float32).contiguous()
        rows, width = hidden.shape
        vocab, chunks = self.weight.shape[0], self.column_max.shape[0]
        estimate = quant_dot_cpu.quant_matmul(hidden, self.panels)
        if chunks * CHUNK != vocab:  # padding logits that can never be a maximum
            estimate = F.pad(estimate, (0, chunks * CHUNK - vocab), value=float("-inf"))
        high = estimate.view(rows, chunks, CHUNK).amax(-1)
        scales = hidden.view(rows, -1, BLOCK).abs().amax(-1) / 127.0  # the kernel's d per block
        grid = (scales @ self.block_mass.T).mul_(0.5 * (1 + 2.0**-13) * (1 + 2.0**-10))
        summation = (hidden.abs() @ self.column_max.T).mul_(width * 2.0**-21)
        largest = high.abs().amax(1, keepdim=True)
        bound = grid + summation + largest * 2.0**-20 + ABSOLUTE_SLACK
        return refine_near_maxima(hidden, self.weight, estimate, high, bound)
