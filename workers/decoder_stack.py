"""The model's decode steps through one native call (`pagedserve_kernels.decoder_stack_cpu`) where
it can.

The model builds its own stack layers once, after loading (`CausalLM.native_stack`: a CPU model
of Llama's layer on one rank, with the native layer ops, every linear layer's int8 panels or
exact 4-bit copy, and no biases); `NativeDecode.build` makes the native stack of them where the
kernels take its dtype (float32 or bfloat16) and geometry. `NativeDecode.forward` then takes each
step that is all decodes (one token per sequence) of at most `max_rows` sequences, without
LoRA; it returns None for every other step, which keeps the
per-operator path. Each product runs on the copy the per-operator path multiplies on: int8
panels where the model keeps them (`quantized_activations`), which it multiplies on at every
batch size, so the stack takes steps of up to `PANEL_MAX_ROWS`; otherwise the exact 4-bit copy,
which the per-operator path takes up to `Q4_MAX_ROWS` rows (with AVX-512 8 in bfloat16, 16 in
float32; with AVX2 32 and 16). (With AVX-512, beyond 8 bfloat16 rows the 4-bit kernel's float32
arithmetic is slower than oneDNN's native bfloat16 product, so the stack stops paying there
(0.76-1.10x the per-operator path at 10-16 rows); an AVX2 CPU has no native bfloat16
products, and the kernel still wins at 32 rows.)

Invariant: where it runs, its results are bit-identical to the per-operator path's (the same
kernels in the same order, `pagedserve_kernels.decoder_stack_cpu`), so the greedy parity tests cover
it; each row's result is independent of the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve_kernels import AttentionStep, decoder_stack_cpu
from pagedserve_kernels.decoder_stack_cpu import DecoderStack, StackLayer, StackShape, panel_bits
from workers.dense_matmul import Q4_MAX_ROWS

PANEL_MAX_ROWS = 64
"""The most decodes a step may have to go through the stack when every product has int8 panels:
the per-operator path runs the same kernels at every batch size, so the stack only saves its
~20 Python-level calls per layer (1.06-1.44x the per-operator path's output rate at 1-64)."""


@dataclass(frozen=True)
class NativeStack:
    """A loaded model's decoder as the native stack takes it: every layer's weights, the
    geometry they share, and the final norm's weight."""

    layers: list[StackLayer]
    shape: StackShape
    final_norm: torch.Tensor


@dataclass(frozen=True)
class NativeDecode:
    """A loaded model's `DecoderStack` and when to use it (see the module doc)."""

    stack: DecoderStack
    max_rows: int
    """The most decodes a step may have to go through the stack."""

    @staticmethod
    def build(parts: NativeStack | None) -> NativeDecode | None:
        """The native stack of a model's `parts`, or None where there are none or the
        kernels cannot run them."""
        if parts is None or not decoder_stack_cpu.available():
            return None
        dtype = parts.layers[0].input_norm.dtype
        try:
            stack = DecoderStack(parts.layers, parts.shape, parts.final_norm, dtype)
        except ValueError:
            return None  # a dtype, geometry or norm the kernels do not take
        on_panels = all(panel_bits(weight) for layer in parts.layers for weight in layer.products)
        return NativeDecode(stack, max_rows=PANEL_MAX_ROWS if on_panels else Q4_MAX_ROWS[dtype])

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        step: AttentionStep,
        kv_pool: torch.Tensor,
    ) -> torch.Tensor | None:
        """The final-normed hidden states of an all-decode step (see the module doc), or None
        where this step is not one the stack takes. `hidden` is the float32 residual stream
        after the embedding (updated in place when the stack runs)."""
        prepared = step.prepared
        decodes = prepared.decode_rows
        rows = hidden.shape[0]
        if (
            decodes is None
            or decodes.rows.shape[0] != rows
            or rows > self.max_rows
            or prepared.slot_mapping is None
            or not self.stack.accepts(hidden, kv_pool)
        ):
            return None
        head_dim = self.stack.shape.head_dim
        cos, sin = (table.reshape(rows, head_dim) for table in cos_sin)
        return self.stack.run(hidden, cos, sin, prepared.slot_mapping, kv_pool, decodes)
