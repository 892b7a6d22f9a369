"""Qwen3 dense: Llama's layer with an RMS norm over each query and key head (`q_norm`,
`k_norm`, one weight of `head_dim` shared by the heads) before the rotary embedding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workers.config import ModelVariant, RopeSpec
from workers.families.base import LLAMA_GGUF_LAYER_TENSORS, DecoderFamily, GgufMetadata
from workers.families.llama import qwen_sliding_windows

QK_NORM_GGUF_TENSORS: Mapping[str, str] = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


class Qwen3(DecoderFamily):
    name = "qwen3"
    hf_names = ("qwen3", "Qwen3ForCausalLM")
    gguf_architecture = "qwen3"
    gguf_qk_permuted = False

    def variant_from_hf(self, config: Mapping[str, Any]) -> ModelVariant:
        super().variant_from_hf(config)
        return ModelVariant(qk_norm=True)

    def variant_from_gguf(
        self, metadata: GgufMetadata, layers: int, rope: RopeSpec
    ) -> ModelVariant:
        return ModelVariant(qk_norm=True)

    def sliding_windows_from_hf(self, config: Mapping[str, Any], layers: int) -> list[int | None]:
        return qwen_sliding_windows(config, layers)

    def gguf_layer_tensors(self) -> Mapping[str, str]:
        return {**LLAMA_GGUF_LAYER_TENSORS, **QK_NORM_GGUF_TENSORS}
