"""The elementwise steps of a decoder layer, behind one protocol: plain torch everywhere, or the
native CPU library (`pagedserve_kernels.layer_ops_cpu`) where it was built.

A model picks its `LayerOps` once (`layer_ops_for`); its layers call it for the residual add and
RMS norm, rotary embeddings with the KV write, and silu(gate) * up. Both implementations compute
the same functions; the native one rounds once per output (see `pagedserve_kernels.layer_ops_cpu`)
and falls back to torch for any operand it does not take, so a model never depends on which runs.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from pagedserve_kernels import AttentionStep, layer_ops_cpu, write_kv
from pagedserve_kernels.metadata import check_prepared
from workers.rope import RotaryEmbedding, apply_rotary


class Norm(Protocol):
    """An RMS norm's parameters (`workers.layers.RMSNorm`)."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class LayerOps(Protocol):
    """What a decoder layer computes between its matmuls and attention."""

    def cos_sin(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's rotary tables for a model computing in `dtype`, as `rotary_write_kv`
        wants them."""
        ...

    def add_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, norm: Norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(`residual + delta`, `norm` of it): the residual stream after a block's output
        (`delta`; None: nothing to add) and the next block's input. `residual` may be updated in
        place; the caller uses only the returned one."""
        ...

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        heads: tuple[int, int, int],
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        step: AttentionStep,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate the query and key heads of a fused `[tokens, (q + 2 kv) * head_dim]` QKV row
        (`heads = (q, kv, head_dim)`), write the keys and values into this step's slots, and
        return the queries `[tokens, q, head_dim]`."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of `[tokens, 2 width]` (`[gate | up]`)."""
        ...


class TorchLayerOps:
    """Plain torch on any device, in the model's dtype."""

    def cos_sin(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary.cos_sin(positions, dtype)
        return cos, sin

    def add_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, norm: Norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            residual = residual + delta
        return residual, norm(residual)

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        heads: tuple[int, int, int],
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        step: AttentionStep,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_q, num_kv, head_dim = heads
        tokens = qkv.shape[0]
        q, k, v = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
        q = apply_rotary(q.view(tokens, num_q, head_dim), *cos_sin)
        k = apply_rotary(k.view(tokens, num_kv, head_dim), *cos_sin)
        v = v.reshape(tokens, num_kv, head_dim)
        write_kv(k, v, k_cache, v_cache, metadata=step.prepared)
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class NativeCpuLayerOps:
    """The native CPU library for contiguous float32 / bfloat16 operands, torch for the rest.

    Rotary tables are float32 (rounded once inside the rotation, not to the model's dtype
    first), and the residual is updated in place. `isa`: the library's instruction set for
    every call (one of `layer_ops_cpu.supported_isas()`; None: the fastest)."""

    def __init__(self, isa: str | None = None) -> None:
        self.torch = TorchLayerOps()
        self.isa = isa

    def cos_sin(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary.cos_sin(positions, torch.float32)
        return cos, sin

    def add_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, norm: Norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        operands = [residual, norm.weight] + ([] if delta is None else [delta])
        if residual.dtype != torch.float32 or not layer_ops_cpu.fits(*operands):
            return self.torch.add_norm(residual, delta, norm)
        normed = layer_ops_cpu.add_rms_norm(
            residual, delta, norm.weight, norm.eps, norm.weight.dtype, self.isa
        )
        return residual, normed

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        heads: tuple[int, int, int],
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        step: AttentionStep,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        slots = step.prepared.slot_mapping
        if slots is None or not layer_ops_cpu.fits(qkv, k_cache, v_cache):
            cos, sin = (t.to(qkv.dtype) for t in cos_sin)
            return self.torch.rotary_write_kv(qkv, heads, (cos, sin), step, k_cache, v_cache)
        tokens, head_dim = qkv.shape[0], heads[2]
        check_prepared(step.prepared, tokens, k_cache, writes=True)
        cos, sin = (t.reshape(tokens, head_dim) for t in cos_sin)
        return layer_ops_cpu.rotary_write_kv(
            qkv, heads, cos, sin, slots, k_cache, v_cache, self.isa
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not layer_ops_cpu.fits(gate_up):
            return self.torch.silu_mul(gate_up)
        return layer_ops_cpu.silu_mul(gate_up, self.isa)


def layer_ops_for(device: torch.device) -> LayerOps:
    """The native library on a CPU where it was built, else plain torch."""
    if device.type == "cpu" and layer_ops_cpu.available():
        return NativeCpuLayerOps()
    return TorchLayerOps()
