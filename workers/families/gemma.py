"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP with

* `(1 + w)` RMS norms (HF stores `w`; llama.cpp's GGUF stores `1 + w` already), and norms after
  the attention and around the MLP (`ModelVariant.sandwich_norms`);
* gelu (tanh approximation) for the gate, embeddings multiplied by `sqrt(hidden_size)`, the
  attention scale `query_pre_attn_scalar ** -0.5`;
* sliding-window layers by `layer_types` (Gemma 2: every other layer from the first; Gemma 3:
  five of every six);
* Gemma 2: soft-capped attention scores and logits; Gemma 3: `(1 + w)` q/k head norms and a
  rope base for the sliding layers of its own (`rope_parameters` per layer type).

GGUF files carry no `query_pre_attn_scalar`: they attend with `head_dim ** -0.5` as llama.cpp
does for the models whose scalar is their head dim (every Gemma but Gemma 2/3 27B).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workers.config import ModelVariant, RopeSpec
from workers.families.base import DecoderFamily, GgufMetadata, hf_activation, layer_type_windows
from workers.families.qwen3 import QK_NORM_GGUF_TENSORS
from workers.hf_rope import rope_from_hf

GEMMA_GGUF_LAYER_TENSORS: Mapping[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

LOCAL_ROPE_BASE = 10000.0
"""Gemma 3's rope base of the sliding layers where the config gives none (llama.cpp's too)."""


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


class Gemma2(DecoderFamily):
    name = "gemma2"
    hf_names = ("gemma2", "Gemma2ForCausalLM")
    gguf_architecture = "gemma2"
    gguf_qk_permuted = False
    sliding_pattern = 2
    """Layer i slides unless `(i + 1) % sliding_pattern == 0` (configs without `layer_types`)."""

    def _common(self, hidden: int, **fields: Any) -> ModelVariant:
        return ModelVariant(
            sandwich_norms=True,
            activation="gelu_tanh",
            embedding_multiplier=float(hidden) ** 0.5,
            **fields,
        )

    def variant_from_hf(self, config: Mapping[str, Any]) -> ModelVariant:
        if hf_activation(config) != "gelu_tanh":
            raise ValueError(
                f"config.json: hidden_activation {config.get('hidden_activation')!r} is not "
                f"supported for {self.name} (supported: gelu_pytorch_tanh)"
            )
        return self._common(
            int(config["hidden_size"]),
            norm_offset=1.0,
            query_pre_attn_scalar=_optional_float(config.get("query_pre_attn_scalar")),
            attention_softcap=_optional_float(config.get("attn_logit_softcapping")),
            final_softcap=_optional_float(config.get("final_logit_softcapping")),
            **self._extra_from_hf(config),
        )

    def _extra_from_hf(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def sliding_windows_from_hf(self, config: Mapping[str, Any], layers: int) -> list[int | None]:
        window = config.get("sliding_window")
        return layer_type_windows(self._layer_types(config, layers), window, layers)

    def _layer_types(self, config: Mapping[str, Any], layers: int) -> list[str]:
        if config.get("layer_types") is not None:
            return list(config["layer_types"])
        pattern = int(config.get("sliding_window_pattern") or self.sliding_pattern)
        return [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ]

    def variant_from_gguf(
        self, metadata: GgufMetadata, layers: int, rope: RopeSpec
    ) -> ModelVariant:
        arch = self.gguf_architecture
        return self._common(
            int(metadata(f"{arch}.embedding_length", 0)),
            attention_softcap=_optional_float(metadata(f"{arch}.attn_logit_softcapping", None)),
            final_softcap=_optional_float(metadata(f"{arch}.final_logit_softcapping", None)),
            **self._extra_from_gguf(metadata, layers, rope),
        )

    def _extra_from_gguf(
        self, metadata: GgufMetadata, layers: int, rope: RopeSpec
    ) -> dict[str, Any]:
        return {}

    def sliding_windows_from_gguf(self, metadata: GgufMetadata, layers: int) -> list[int | None]:
        window = metadata(f"{self.gguf_architecture}.attention.sliding_window", None)
        pattern = self.sliding_pattern
        return [
            None if not window or (i + 1) % pattern == 0 else int(window) for i in range(layers)
        ]

    def gguf_layer_tensors(self) -> Mapping[str, str]:
        return GEMMA_GGUF_LAYER_TENSORS


class Gemma3(Gemma2):
    name = "gemma3"
    hf_names = ("gemma3_text", "Gemma3ForCausalLM")
    gguf_architecture = "gemma3"
    sliding_pattern = 6

    def _extra_from_hf(self, config: Mapping[str, Any]) -> dict[str, Any]:
        layers = int(config["num_hidden_layers"])
        params = config.get("rope_parameters") or {}
        if "full_attention" in params or "sliding_attention" in params:
            by_type = {
                kind: rope_from_hf({**config, "rope_parameters": params[kind]})
                for kind in ("full_attention", "sliding_attention")
            }
        else:  # older configs: rope_theta (+ rope_scaling) global, rope_local_base_freq local
            local = float(config.get("rope_local_base_freq", LOCAL_ROPE_BASE))
            by_type = {
                "full_attention": rope_from_hf(config),
                "sliding_attention": RopeSpec(theta=local),
            }
        ropes = tuple(by_type[kind] for kind in self._layer_types(config, layers))
        return {"qk_norm": True, "layer_ropes": ropes}

    def _extra_from_gguf(
        self, metadata: GgufMetadata, layers: int, rope: RopeSpec
    ) -> dict[str, Any]:
        arch = self.gguf_architecture
        local = RopeSpec(theta=float(metadata(f"{arch}.rope.freq_base_swa", LOCAL_ROPE_BASE)))
        pattern = self.sliding_pattern
        ropes = tuple(rope if (i + 1) % pattern == 0 else local for i in range(layers))
        return {"qk_norm": True, "layer_ropes": ropes}

    def gguf_layer_tensors(self) -> Mapping[str, str]:
        return {**GEMMA_GGUF_LAYER_TENSORS, **QK_NORM_GGUF_TENSORS}
