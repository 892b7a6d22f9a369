"""The model families we run, each in its own module behind the `Family` protocol.

`family_named` maps an HF `model_type` / `architectures` entry (or our name) to its family,
`gguf_family` a GGUF file's `general.architecture` and metadata; an unknown one raises a
ValueError listing the supported ones.
"""

from __future__ import annotations

from workers.families.base import DecoderFamily, Family, GgufMetadata
from workers.families.gemma import Gemma2, Gemma3
from workers.families.llama import Llama, Mistral, Qwen2
from workers.families.moe import Mixtral, Qwen3Moe
from workers.families.phi3 import Phi3
from workers.families.qwen3 import Qwen3

FAMILIES: tuple[Family, ...] = (
    Llama(),
    Mistral(),
    Qwen2(),
    Qwen3(),
    Gemma2(),
    Gemma3(),
    Phi3(),
    Mixtral(),
    Qwen3Moe(),
)
"""Every family, in the order `supported_architectures` lists them."""


def supported_architectures() -> list[str]:
    return sorted(family.name for family in FAMILIES)


def family_named(name: str) -> Family:
    """The family an HF or GGUF architecture name means (ValueError naming the supported)."""
    for family in FAMILIES:
        if name in (*family.hf_names, family.gguf_architecture, family.name):
            return family
    raise ValueError(f"unknown model architecture {name!r}; supported: {supported_architectures()}")


def gguf_family(architecture: str, metadata: GgufMetadata) -> Family:
    """The family of a GGUF file: its `general.architecture`, with or without experts (a
    ValueError naming the supported ones)."""
    for family in FAMILIES:
        if family.claims_gguf(architecture, metadata):
            return family
    supported = sorted(
        f"{family.gguf_architecture}{' with experts' if family.gguf_experts else ''}"
        for family in FAMILIES
    )
    experts = int(metadata(f"{architecture}.expert_count", 0) or 0)
    described = f"{architecture!r}" + (f" with {experts} experts" if experts else "")
    raise ValueError(
        f"unknown model architecture {described} (GGUF general.architecture); supported: "
        f"{supported}"
    )


def knows(name: str) -> bool:
    return any(name in family.hf_names or name == family.gguf_architecture for family in FAMILIES)


__all__ = [
    "FAMILIES",
    "DecoderFamily",
    "Family",
    "GgufMetadata",
    "family_named",
    "gguf_family",
    "knows",
    "supported_architectures",
]
