"""Phi-3 and Phi-4-mini: Llama's layer with the q/k/v projections fused into `qkv_proj` and
gate/up into `gate_up_proj` in the checkpoint (split at load, `FusedSplitView`), LongRoPE
(`longrope` / `su`) and, for Phi-4-mini, a partial rotary; one sliding window for every layer
where the config gives one. llama.cpp's GGUF fuses them as `attn_qkv` and `ffn_up`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from workers.checkpoint import CheckpointReader
from workers.config import ModelSpec
from workers.families.base import LLAMA_GGUF_LAYER_TENSORS, DecoderFamily

PHI3_GGUF_LAYER_TENSORS: Mapping[str, str] = {
    **{k: v for k, v in LLAMA_GGUF_LAYER_TENSORS.items() if "attn_" not in k or "norm" in k},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}


class FusedSplitView:
    """A `CheckpointReader` that reads `q_proj`/`k_proj`/`v_proj` as row ranges of `qkv_proj`
    and `gate_proj`/`up_proj` of `gate_up_proj` (every other name as stored)."""

    def __init__(self, reader: CheckpointReader, spec: ModelSpec) -> None:
        self.reader = reader
        q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        width = spec.intermediate_size
        self.parts: dict[str, tuple[str, int, int]] = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_rows + 2 * kv_rows),
            "self_attn.k_proj": ("self_attn.qkv_proj", q_rows, q_rows + 2 * kv_rows),
            "self_attn.v_proj": ("self_attn.qkv_proj", q_rows + kv_rows, q_rows + 2 * kv_rows),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2 * width),
            "mlp.up_proj": ("mlp.gate_up_proj", width, 2 * width),
        }

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
        prefix, _, suffix = name.rpartition(".")
        for part, (fused, offset, rows) in self.parts.items():
            if prefix.endswith(part) and dim == 0:
                fused_name = f"{prefix[: -len(part)]}{fused}.{suffix}"
                stop = expected_shape[0] if stop is None else stop
                shape = (rows, *expected_shape[1:])
                return self.reader.read(fused_name, shape, 0, offset + start, offset + stop)
        return self.reader.read(name, expected_shape, dim, start, stop)


class Phi3(DecoderFamily):
    name = "phi3"
    hf_names = ("phi3", "Phi3ForCausalLM")
    gguf_architecture = "phi3"
    gguf_qk_permuted = False

    def sliding_windows_from_hf(self, config: Mapping[str, Any], layers: int) -> list[int | None]:
        window = config.get("sliding_window")
        return [None if window is None else int(window)] * layers

    def gguf_layer_tensors(self) -> Mapping[str, str]:
        return PHI3_GGUF_LAYER_TENSORS

    def checkpoint_view(self, reader: CheckpointReader, spec: ModelSpec) -> CheckpointReader:
        return FusedSplitView(reader, spec)  # type: ignore[return-value]
