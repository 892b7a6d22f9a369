"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a softmax router picks each token's
top-k experts, each a gated MLP, and their outputs are summed with the router's weights.

Parallelism follows `TensorParallel.expert_parallel`. Off: every rank holds every expert with
the intermediate columns split as the dense MLP splits them. On (vLLM's
`enable_expert_parallel`): rank r holds whole experts `[r E / n, (r + 1) E / n)`. Either way each
rank computes a partial sum for every token and the TP group's all-reduce combines them (the
router is replicated, so every rank routes alike).

The per-expert products are grouped: the step's (token, expert) pairs are sorted by expert and
each local expert multiplies its tokens' rows in one product (on CUDA, one grouped Triton launch
per projection for all experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.checkpoint import CheckpointReader
from workers.config import ModelSpec
from workers.parallel import TensorParallel, even_range


class SparseMoE(torch.nn.Module):
    def __init__(
        self, spec: ModelSpec, layer_index: int, tp: TensorParallel, dtype: torch.dtype
    ) -> None:
        super().__init__()
        variant = spec.variant
        self.tp = tp
        self.num_experts = variant.num_experts
        self.top_k = variant.experts_per_token
        self.normalize = variant.norm_topk_prob
        self.hidden = spec.hidden_size
        self.width = variant.expert_intermediate_size or spec.intermediate_size
        if tp.expert_parallel:
            self.experts = even_range(self.num_experts, tp)
            self.columns = (0, self.width)
        else:
            self.experts = (0, self.num_experts)
            self.columns = even_range(self.width, tp)
        local = self.experts[1] - self.experts[0]
        columns = self.columns[1] - self.columns[0]
        self.router = torch.nn.Parameter(
            torch.zeros(self.num_experts, self.hidden, dtype=dtype), requires_grad=False
        )
        self.gate_up = torch.nn.Parameter(
            torch.zeros(local, 2 * columns, self.hidden, dtype=dtype), requires_grad=False
        )
        self.down = torch.nn.Parameter(
            torch.zeros(local, self.hidden, columns, dtype=dtype), requires_grad=False
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights `[tokens, k]` in x's dtype, expert ids `[tokens, k]`) of every token."""
        logits = F.linear(x, self.router)
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, lora: object | None = None) -> torch.Tensor:
        if lora is not None:
            raise ValueError("LoRA adapters on mixture-of-experts layers are not supported")
        weights, experts = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens_of = order // self.top_k
        weight_of = weights.reshape(-1)[order]
        first = sum(counts[: self.experts[0]])
        local_counts = counts[self.experts[0] : self.experts[1]]
        stop = first + sum(local_counts)
        rows = tokens_of[first:stop]  # this rank's (token, expert) pairs, by expert
        out = torch.zeros_like(x)
        if rows.numel():
            y = self.expert_products(x[rows], local_counts, triton=x.is_cuda)
            out.index_add_(0, rows, y * weight_of[first:stop, None])
        return self.tp.all_reduce(out)

    def expert_products(self, rows: torch.Tensor, counts: list[int], triton: bool) -> torch.Tensor:
        """Each local expert's gated MLP over its `rows` (sorted by expert, `counts[e]` rows
        of local expert e): one product per expert (torch), or one grouped Triton launch per
        projection (`pagedserve_kernels.triton_grouped_gemm`)."""
        if triton:
            from pagedserve_kernels.triton_grouped_gemm import grouped_matmul

            offsets = torch.tensor([0, *counts]).cumsum(0)
            gate, up = grouped_matmul(rows, self.gate_up, offsets).chunk(2, dim=-1)
            return grouped_matmul((F.silu(gate) * up).contiguous(), self.down, offsets)
        outputs, start = [], 0
        for local, count in enumerate(counts):
            if count:
                gate, up = F.linear(rows[start : start + count], self.gate_up[local]).chunk(2, -1)
                outputs.append(F.linear(F.silu(gate) * up, self.down[local]))
            start += count
        return torch.cat(outputs)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        """Router `<prefix>gate.weight`, expert e's `<prefix>experts.<e>.{gate,up,down}_proj`."""
        self.router.copy_(reader.read(f"{prefix}gate.weight", (self.num_experts, self.hidden)))
        start, stop = self.columns
        full = (self.width, self.hidden)
        for local, expert in enumerate(range(*self.experts)):
            name = f"{prefix}experts.{expert}."
            gate = reader.read(f"{name}gate_proj.weight", full, 0, start, stop)
            up = reader.read(f"{name}up_proj.weight", full, 0, start, stop)
            self.gate_up[local].copy_(torch.cat((gate, up)))
            down = reader.read(f"{name}down_proj.weight", (self.hidden, self.width), 1, start, stop)
            self.down[local].copy_(down)
