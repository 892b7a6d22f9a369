"""Mixture-of-experts families: Mixtral (softmax top-2, renormalized) and Qwen3-MoE (Qwen3's
attention, softmax top-k renormalized where `norm_topk_prob`). Their MLPs are
`workers.moe.SparseMoE`; Mixtral's checkpoint names (`block_sparse_moe`, `w1`/`w3`/`w2`), from
an HF directory or from llama.cpp's expert stacks, are read under Qwen3-MoE's (`mlp`,
`gate_proj`/`up_proj`/`down_proj`) by `MixtralNamesView`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from workers.checkpoint import CheckpointReader
from workers.config import ModelSpec, ModelVariant, RopeSpec
from workers.families.base import (
    LLAMA_GGUF_LAYER_TENSORS,
    DecoderFamily,
    GgufMetadata,
    hf_activation,
)
from workers.families.llama import Mistral, qwen_sliding_windows
from workers.families.qwen3 import QK_NORM_GGUF_TENSORS

EXPERT_GGUF_TENSORS: Mapping[str, str] = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.*.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.*.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.*.down_proj.weight",
}
"""llama.cpp's router and expert stacks (`[experts, rows, columns]`; `*` is the expert)."""

MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def mixtral_name(name: str) -> str:
    """Mixtral's checkpoint name of an MoE parameter the layers read (`mlp.gate.weight` ->
    `block_sparse_moe.gate.weight`, `mlp.experts.3.gate_proj.weight` -> `...experts.3.w1...`);
    other names unchanged."""
    if name.startswith("mlp."):
        name = "block_sparse_moe." + name.removeprefix("mlp.")
    elif ".mlp." in name:
        name = name.replace(".mlp.", ".block_sparse_moe.", 1)
    else:
        return name
    for ours, theirs in MIXTRAL_EXPERT_NAMES.items():
        name = name.replace(f".{ours}.", f".{theirs}.")
    return name


MIXTRAL_GGUF_TENSORS: Mapping[str, str] = {
    **LLAMA_GGUF_LAYER_TENSORS,
    **{gguf_name: mixtral_name(hf) for gguf_name, hf in EXPERT_GGUF_TENSORS.items()},
}
"""llama.cpp's Mixtral (`general.architecture` `llama` with experts): Llama's layer, the
router and the expert stacks, under Mixtral's HF names (so one view reads both sources)."""


class MixtralNamesView:
    """A `CheckpointReader` reading `mlp.*` names from Mixtral's `block_sparse_moe.*`."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader

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
        return self.reader.read(mixtral_name(name), expected_shape, dim, start, stop)


def _silu_only(family: str, config: Mapping[str, Any]) -> None:
    if hf_activation(config) != "silu":
        raise ValueError(f"config.json: hidden_act must be silu for {family}")


class Mixtral(Mistral):
    """Mixtral; in GGUF, llama.cpp's `llama` architecture with `llama.expert_count` experts,
    `llama.expert_used_count` per token, Q/K rows permuted as for Llama."""

    name = "mixtral"
    hf_names = ("mixtral", "MixtralForCausalLM")
    gguf_architecture = "llama"
    gguf_experts = True

    def variant_from_hf(self, config: Mapping[str, Any]) -> ModelVariant:
        _silu_only(self.name, config)
        return ModelVariant(
            num_experts=int(config["num_local_experts"]),
            experts_per_token=int(config.get("num_experts_per_tok", 2)),
            norm_topk_prob=True,
        )

    def variant_from_gguf(
        self, metadata: GgufMetadata, layers: int, rope: RopeSpec
    ) -> ModelVariant:
        arch = self.gguf_architecture
        return ModelVariant(
            num_experts=int(metadata(f"{arch}.expert_count", 0)),
            experts_per_token=int(metadata(f"{arch}.expert_used_count", 2)),
            norm_topk_prob=True,  # llama.cpp renormalizes Mixtral's top-2 weights
        )

    def gguf_layer_tensors(self) -> Mapping[str, str]:
        return MIXTRAL_GGUF_TENSORS

    def checkpoint_view(self, reader: CheckpointReader, spec: ModelSpec) -> CheckpointReader:
        return MixtralNamesView(reader)  # type: ignore[return-value]


class Qwen3Moe(DecoderFamily):
    name = "qwen3_moe"
    hf_names = ("qwen3_moe", "Qwen3MoeForCausalLM")
    gguf_architecture = "qwen3moe"
    gguf_experts = True
    gguf_qk_permuted = False

    def variant_from_hf(self, config: Mapping[str, Any]) -> ModelVariant:
        _silu_only(self.name, config)
        if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(
                "config.json: mlp_only_layers and decoder_sparse_step != 1 (dense layers "
                "among the sparse ones) are not supported"
            )
        return ModelVariant(
            qk_norm=True,
            num_experts=int(config.get("num_experts") or config["num_local_experts"]),
            experts_per_token=int(config["num_experts_per_tok"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            expert_intermediate_size=int(config["moe_intermediate_size"]),
        )

    def sliding_windows_from_hf(self, config: Mapping[str, Any], layers: int) -> list[int | None]:
        return qwen_sliding_windows(config, layers)

    def variant_from_gguf(
        self, metadata: GgufMetadata, layers: int, rope: RopeSpec
    ) -> ModelVariant:
        arch = self.gguf_architecture
        return ModelVariant(
            qk_norm=True,
            num_experts=int(metadata(f"{arch}.expert_count", 0)),
            experts_per_token=int(metadata(f"{arch}.expert_used_count", 0)),
            norm_topk_prob=True,  # llama.cpp renormalizes Qwen3-MoE's top-k weights
            expert_intermediate_size=int(metadata(f"{arch}.expert_feed_forward_length", 0)),
        )

    def gguf_layer_tensors(self) -> Mapping[str, str]:
        return {**LLAMA_GGUF_LAYER_TENSORS, **QK_NORM_GGUF_TENSORS, **EXPERT_GGUF_TENSORS}
