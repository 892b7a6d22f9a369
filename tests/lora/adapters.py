"""Build PEFT adapters for the tests: PEFT's own `get_peft_model` + `save_pretrained`, with B
drawn at random (seeded) so every adapter changes the model's outputs (PEFT starts B at zero)."""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Sequence

import torch
import transformers

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(
    base: transformers.PreTrainedModel,
    directory: pathlib.Path,
    *,
    rank: int,
    targets: Sequence[str],
    seed: int,
    alpha: float = 16.0,
    use_rslora: bool = False,
    std: float = 0.05,
) -> transformers.PreTrainedModel:
    """Writes the adapter to `directory` and returns the PEFT model (the oracle; it wraps
    `base`'s modules, so unload it with `unwrap` before building another)."""
    import peft

    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        lora_dropout=0.0,
        use_rslora=use_rslora,
        init_lora_weights=True,
    )
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    model.save_pretrained(str(directory))
    return model.eval()


def unwrap(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """The base model with the adapter's layers removed (unmerged, as it was)."""
    return model.unload()


def copy_adapter(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """The same adapter files under another directory (same weights, another path)."""
    shutil.copytree(source, target)
    return target
