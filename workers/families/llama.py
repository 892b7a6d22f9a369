"""The Llama family proper: Llama (and SmolLM2), Mistral, Qwen2."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workers.config import ModelVariant, RopeSpec
from workers.families.base import DecoderFamily, GgufMetadata, layer_type_windows


class Llama(DecoderFamily):
    """Llama and SmolLM2: no sliding window, no biases unless `attention_bias`."""


class Mistral(DecoderFamily):
    """Mistral: one sliding window for every layer (`sliding_window`, null: none)."""

    name = "mistral"
    hf_names = ("mistral", "MistralForCausalLM")
    gguf_architecture = "mistral"

    def sliding_windows_from_hf(self, config: Mapping[str, Any], layers: int) -> list[int | None]:
        window = config.get("sliding_window")
        if config.get("layer_types") is not None:
            return layer_type_windows(config["layer_types"], window, layers)
        return [None if window is None else int(window)] * layers


class Qwen2(DecoderFamily):
    """Qwen2: q/k/v biases (no `o_proj` bias); sliding windows from `max_window_layers` on."""

    name = "qwen2"
    hf_names = ("qwen2", "Qwen2ForCausalLM")
    gguf_architecture = "qwen2"
    gguf_qk_permuted = False

    def default_attention_bias(self) -> bool:
        return True

    def variant_from_hf(self, config: Mapping[str, Any]) -> ModelVariant:
        super().variant_from_hf(config)
        return ModelVariant(output_bias=False)

    def variant_from_gguf(
        self, metadata: GgufMetadata, layers: int, rope: RopeSpec
    ) -> ModelVariant:
        return ModelVariant(output_bias=False)

    def sliding_windows_from_hf(self, config: Mapping[str, Any], layers: int) -> list[int | None]:
        return qwen_sliding_windows(config, layers)


def qwen_sliding_windows(config: Mapping[str, Any], layers: int) -> list[int | None]:
    """Qwen's rule: windows only with `use_sliding_window`, per `layer_types` where given, else
    from layer `max_window_layers` on."""
    window = config.get("sliding_window")
    if window is None:
        return [None] * layers
    if config.get("layer_types") is not None:
        return layer_type_windows(config["layer_types"], window, layers)
    if not config.get("use_sliding_window", False):
        return [None] * layers
    first = int(config.get("max_window_layers", layers))
    return [int(window) if i >= first else None for i in range(layers)]
