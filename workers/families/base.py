"""What a model family is to the loader: its names, its config fields and its checkpoint names.

A `Family` turns an HF `config.json` or GGUF metadata into the family's `ModelVariant` and
per-layer sliding windows, names its GGUF tensors in llama.cpp's scheme, and may present a
checkpoint under the names the layers read (`checkpoint_view`). `DecoderFamily` is Llama's
behaviour; each family module overrides only what differs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from workers.checkpoint import CheckpointReader
from workers.config import ModelSpec, ModelVariant, RopeSpec

GgufMetadata = Callable[[str, Any], Any]
"""`metadata(key, default)`: a GGUF metadata value (its architecture prefix spelled out)."""

LLAMA_GGUF_LAYER_TENSORS: Mapping[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
"""llama.cpp's per-layer tensor names (after `blk.N.`) -> HF's (after `model.layers.N.`)."""


class Family(Protocol):
    """One architecture family (see the module doc)."""

    name: str
    """Our architecture name (what `ModelInfo.architecture` reports)."""
    hf_names: tuple[str, ...]
    """HF `model_type` and `architectures` entries that mean this family."""
    gguf_architecture: str
    """GGUF `general.architecture` (also the prefix of its metadata keys)."""
    gguf_experts: bool
    """Whether its GGUF files carry experts (`{architecture}.expert_count` > 0): llama.cpp
    writes Mixtral as `llama` with experts."""
    gguf_qk_permuted: bool
    """Whether llama.cpp's converter permuted the Q/K rows (interleaved rotary pairs)."""

    def claims_gguf(self, architecture: str, metadata: GgufMetadata) -> bool: ...

    def default_attention_bias(self) -> bool: ...

    def variant_from_hf(self, config: Mapping[str, Any]) -> ModelVariant: ...

    def sliding_windows_from_hf(
        self, config: Mapping[str, Any], layers: int
    ) -> list[int | None]: ...

    def variant_from_gguf(
        self, metadata: GgufMetadata, layers: int, rope: RopeSpec
    ) -> ModelVariant: ...

    def sliding_windows_from_gguf(
        self, metadata: GgufMetadata, layers: int
    ) -> list[int | None]: ...

    def gguf_layer_tensors(self) -> Mapping[str, str]: ...

    def checkpoint_view(self, reader: CheckpointReader, spec: ModelSpec) -> CheckpointReader: ...


def hf_activation(config: Mapping[str, Any]) -> str:
    """The gated MLP's activation, `silu` or `gelu_tanh`; a ValueError names anything else."""
    name = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if name == "silu":
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new"):
        return "gelu_tanh"
    raise ValueError(
        f"config.json: hidden_act {name!r} is not supported (supported: silu, gelu_pytorch_tanh)"
    )


def layer_type_windows(layer_types: list[str], window: int | None, layers: int) -> list[int | None]:
    """Per-layer windows of an HF `layer_types` list (`sliding_attention` layers get `window`)."""
    if len(layer_types) != layers:
        raise ValueError("config.json: layer_types must have one entry per layer")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(
            f"config.json: layer_types {unknown} are not supported "
            "(supported: sliding_attention, full_attention)"
        )
    if window is None:
        return [None] * layers
    return [int(window) if kind == "sliding_attention" else None for kind in layer_types]


class DecoderFamily:
    """Llama's behaviour for every `Family` method; subclasses override what differs."""

    name = "llama"
    hf_names: tuple[str, ...] = ("llama", "LlamaForCausalLM")
    gguf_architecture = "llama"
    gguf_experts = False
    gguf_qk_permuted = True

    def claims_gguf(self, architecture: str, metadata: GgufMetadata) -> bool:
        """Whether a GGUF file of this `general.architecture` and metadata is this family's."""
        experts = int(metadata(f"{architecture}.expert_count", 0) or 0)
        return architecture == self.gguf_architecture and (experts > 0) == self.gguf_experts

    def default_attention_bias(self) -> bool:
        return False

    def variant_from_hf(self, config: Mapping[str, Any]) -> ModelVariant:
        if hf_activation(config) != "silu":
            raise ValueError(
                f"config.json: hidden_act {config.get('hidden_act')!r} is not supported "
                f"for {self.name} (supported: silu)"
            )
        return ModelVariant()

    def sliding_windows_from_hf(self, config: Mapping[str, Any], layers: int) -> list[int | None]:
        return [None] * layers

    def variant_from_gguf(
        self, metadata: GgufMetadata, layers: int, rope: RopeSpec
    ) -> ModelVariant:
        return ModelVariant()

    def sliding_windows_from_gguf(self, metadata: GgufMetadata, layers: int) -> list[int | None]:
        window = metadata(f"{self.gguf_architecture}.attention.sliding_window", None)
        return [int(window) if window else None] * layers

    def gguf_layer_tensors(self) -> Mapping[str, str]:
        return LLAMA_GGUF_LAYER_TENSORS

    def checkpoint_view(self, reader: CheckpointReader, spec: ModelSpec) -> CheckpointReader:
        return reader
