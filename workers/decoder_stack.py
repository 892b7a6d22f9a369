"""The model's decode steps through one native call (`kernels.decoder_stack_cpu`) where it can.

`NativeDecode.build(model)` says once, after loading, whether the whole stack can run natively:
a CPU model of Llama's layer (`ModelVariant` at its defaults) on one rank, float32 or
bfloat16, with the native layer ops, every linear layer's exact 4-bit copy and no biases.
`NativeDecode.forward` then takes each step that is all decodes
(one token per sequence) of at most `max_rows` sequences (by default where the per-operator path
multiplies on the 4-bit copy too: `Q4_MAX_ROWS`, 8 in bfloat16, 16 in float32), in the paged
layout and without LoRA; it returns None for every other step, which keeps the per-operator
path. (Beyond 8 bfloat16 rows the 4-bit kernel's float32 arithmetic is slower than oneDNN's
bfloat16 product, so the stack stops paying there: benchmarks/README.md, "Figures behind
choices in the code".)

Invariant: where it runs, its results are bit-identical to the per-operator path's (the same
kernels in the same order, `kernels.decoder_stack_cpu`), so the greedy parity tests cover it;
each row's result is independent of the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels import AttentionStep, decoder_stack_cpu
from kernels.decoder_stack_cpu import DecoderStack, StackLayer, StackShape
from workers.dense_matmul import Q4_MAX_ROWS
from workers.layer_ops import NativeCpuLayerOps

if TYPE_CHECKING:
    from workers.model import CausalLM


@dataclass(frozen=True)
class NativeDecode:
    """A loaded model's `DecoderStack` and when to use it (see the module doc)."""

    stack: DecoderStack
    max_rows: int
    """The most decodes a step may have to go through the stack."""

    @staticmethod
    def build(model: CausalLM) -> NativeDecode | None:
        """The native stack of a loaded model, or None where it cannot run it."""
        spec = model.spec
        usable = (
            decoder_stack_cpu.available()
            and isinstance(model.ops, NativeCpuLayerOps)
            and model.tp.world_size == 1
            and len(model.layers) > 0
            and spec.variant.is_default  # the stack computes Llama's layer only
        )
        if not usable:
            return None
        layers = []
        for index, layer in enumerate(model.layers):
            attention, mlp = layer.self_attn, layer.mlp
            linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(linear.matmul.q4 is None or linear.bias is not None for linear in linears):
                return None  # no exact 4-bit copy, or a bias the stack does not add
            qkv, out, gate_up, down = (linear.matmul.q4 for linear in linears)
            layers.append(
                StackLayer(
                    input_norm=layer.input_layernorm.weight.detach(),
                    qkv=qkv,
                    out=out,
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate_up=gate_up,
                    down=down,
                    window=spec.layer_sliding_windows[index],
                )
            )
        first = model.layers[0].self_attn
        shape = StackShape(
            hidden=spec.hidden_size,
            num_q=first.num_q,
            num_kv=first.num_kv,
            head_dim=first.head_dim,
            intermediate=model.layers[0].mlp.down_proj.weight.shape[1],
            eps=model.norm.eps,
            scale=first.scale,
        )
        dtype = layers[0].input_norm.dtype
        try:
            stack = DecoderStack(layers, shape, model.norm.weight.detach(), dtype)
        except ValueError:
            return None  # a dtype, geometry or norm the kernels do not take
        return NativeDecode(stack, max_rows=Q4_MAX_ROWS[dtype])

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        step: AttentionStep,
        kv_pool: torch.Tensor,
        paged: bool,
    ) -> torch.Tensor | None:
        """The final-normed hidden states of an all-decode step (see the module doc), or None
        where this step is not one the stack takes. `hidden` is the float32 residual stream
        after the embedding (updated in place when the stack runs)."""
        prepared = step.prepared
        decodes = prepared.decode_rows
        rows = hidden.shape[0]
        if (
            not paged
            or decodes is None
            or decodes.rows.shape[0] != rows
            or rows > self.max_rows
            or prepared.slot_mapping is None
            or not self.stack.accepts(hidden, kv_pool)
        ):
            return None
        head_dim = self.stack.shape.head_dim
        cos, sin = (table.reshape(rows, head_dim) for table in cos_sin)
        return self.stack.run(hidden, cos, sin, prepared.slot_mapping, kv_pool, decodes)
