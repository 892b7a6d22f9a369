"""The reduced-precision modes' LM head: bfloat16 screening, float32 refinement of the top.

A float32 LM head over a 49k vocabulary reads and multiplies ~113 MB of weights per decode step
(a large share of SmolLM2-135M's bfloat16 decode step); the same product in bfloat16 is much
faster but moves every logit by up to ~0.2, which flips greedy choices. `ScreenedHead`
keeps both: it computes every logit in bfloat16, bounds each one's error rigorously, and
recomputes in float32 every logit whose upper bound reaches the best lower bound of its row.

Invariants (for finite inputs):
- every returned logit that could be its row's maximum is the float32 product `h . W_n` computed
  by `F.linear` on the float32 weights (over a subset of the rows, so its float32 summation order,
  and its last bits, may differ from the full product's), so the row's argmax is the plain
  float32 LM head's except between logits within float32 rounding of each other;
- every other logit is the float32 value (a candidate of another row of the batch) or the
  bfloat16 estimate, within its bound of the float32 value and below the row's maximum.

The bound: rounding `h` and `W` to bfloat16 (unit roundoff u = 2^-8) perturbs each product by at
most (2u + u^2)|h_k||W_nk|, the float32 accumulation of oneDNN's bfloat16 GEMM adds at most
K * 2^-24 of the absolute sum, and rounding the output to bfloat16 at most u(1 + u)|estimate|
(taken at the row's largest |estimate|). `sum_k |h_k||W_nk|` is bounded per chunk of `CHUNK`
vocabulary rows by `|h| . colmax_chunk(|W|)` (one small matmul), so the bound is one number per
(row, chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.dense_matmul import DenseMatmul

CHUNK = 64
"""Vocabulary rows that share one column-wise maximum of |W| in the bound."""

UNIT_ROUNDOFF = 2.0**-8
"""bfloat16's unit roundoff (8 significant bits, round to nearest)."""

ABSOLUTE_SLACK = 1e-6
"""Added to every bound: covers bfloat16 subnormals (the relative terms cover float32 rounding)."""


@dataclass(frozen=True)
class ScreenedHead:
    """Derived copies of a float32 LM-head weight ``[vocab, hidden]`` (built by ``of``).

    ``screen``: the weight in bfloat16, zero-padded to whole chunks; ``column_max``:
    ``[chunks, hidden]`` float32, the maximum of |W| over each chunk's rows, slightly inflated
    (so the bound stays an upper bound after its own float32 rounding); ``screen_matmul``: the
    product with ``screen`` (prepacked for oneDNN where possible).
    """

    weight: torch.Tensor
    screen: torch.Tensor
    column_max: torch.Tensor
    screen_matmul: DenseMatmul

    @classmethod
    def of(cls, weight: torch.Tensor) -> ScreenedHead:
        """Screening data for ``weight`` (float32, ``[vocab, hidden]``; kept by reference)."""
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"ScreenedHead needs a 2-d float32 weight, got {weight.dtype}")
        rows, hidden = weight.shape
        padded = -(-rows // CHUNK) * CHUNK
        screen = torch.zeros(padded, hidden, dtype=torch.bfloat16, device=weight.device)
        screen[:rows] = weight
        magnitude = torch.zeros(padded, hidden, dtype=torch.float32, device=weight.device)
        magnitude[:rows] = weight.abs()
        column_max = magnitude.view(-1, CHUNK, hidden).amax(1) * (1 + 2.0**-20)
        screen_matmul = DenseMatmul(screen)
        screen_matmul.pack()
        return cls(weight, screen, column_max, screen_matmul)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of float32 ``hidden`` ``[rows, hidden]`` (see the
        module's invariants).

        Three cheap passes over the ``[rows, vocab]`` estimate (its float32 copy, its maxima per
        chunk, its minima per row); the element-wise test runs only inside the chunks that could
        hold a maximum.
        """
        hidden = hidden.to(torch.float32)
        rows, vocab = hidden.shape[0], self.weight.shape[0]
        chunks = self.column_max.shape[0]
        estimate = self.screen_matmul(hidden.to(torch.bfloat16)).to(torch.float32)
        by_chunk = estimate.view(rows, chunks, CHUNK)
        high = by_chunk.amax(-1)  # (not aminmax: far slower); padding columns are zeros
        if chunks * CHUNK != vocab:  # they must not set the floor of the last chunk, though
            high[:, -1] = estimate[:, (chunks - 1) * CHUNK : vocab].amax(1)
        u = UNIT_ROUNDOFF
        accumulate = hidden.shape[1] * 2.0**-24  # float32 sums of `hidden` terms: relative error
        scale = (2 * u + u * u + accumulate * (1 + u) ** 2) * (1 + 2 * accumulate)
        largest = torch.maximum(high.amax(1), -estimate.amin(1)).unsqueeze(1)  # max |estimate|
        bound = (hidden.abs() @ self.column_max.T).mul_(scale)  # a float32 sum: inflated above
        # output rounding, plus the float32 rounding of `high -/+ bound` near `largest`
        bound += largest * (u * (1 + u) + 2.0**-20) + ABSOLUTE_SLACK  # [rows, chunks]
        return refine_near_maxima(hidden, self.weight, estimate, high, bound)


def refine_near_maxima(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    estimate: torch.Tensor,
    high: torch.Tensor,
    bound: torch.Tensor,
) -> torch.Tensor:
    """Float32 logits `[rows, vocab]`: `estimate` `[rows, chunks * CHUNK]` (each logit within
    `bound[row, chunk]` of the float32 product; `high` its maxima per chunk), with every logit
    whose upper bound reaches its row's best lower bound recomputed in float32 by `F.linear`
    on `weight` `[vocab, hidden]` (for the whole batch: a candidate of one row is exact in
    all)."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    by_chunk = estimate.view(rows, -1, CHUNK)
    best_lower = (high - bound).amax(1, keepdim=True)
    near = torch.nonzero((high + bound >= best_lower).any(0)).view(-1)
    inside = by_chunk.index_select(1, near) + bound.index_select(1, near).unsqueeze(-1)
    hits = (inside >= best_lower.unsqueeze(-1)).any(0)  # [near chunks, CHUNK]
    columns = (near.unsqueeze(1) * CHUNK + torch.arange(CHUNK)).masked_select(hits)
    columns = columns[columns < vocab]
    logits = estimate[:, :vocab]
    if columns.numel():
        logits.index_copy_(1, columns, F.linear(hidden, weight.index_select(0, columns)))
    return logits.contiguous()
