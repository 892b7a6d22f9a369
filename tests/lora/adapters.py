"""Build PEFT adapters for the tests: PEFT's own `get_peft_model` + `save_pretrained`, with B
drawn at random (seeded) so every adapter changes the model's outputs (PEFT starts B at zero)."""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Sequence
from typing import Any

import torch
import transformers

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SMOLLM2_ADAPTERS: dict[str, dict[str, Any]] = {
    "all8": {"rank": 8, "targets": ALL_PROJECTIONS, "seed": 21, "std": 0.04},
    "qv16": {"rank": 16, "targets": ("q_proj", "v_proj"), "seed": 22, "std": 0.06},
}
"""The SmolLM2 parity tests' adapters: rank 8 on all seven projections, rank 16 on q/v."""
Reference = tuple[list[int], torch.Tensor]
"""HF's greedy tokens for one prompt and its logits `[new_tokens, vocab]`."""


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


def peft_greedy_references(
    base: transformers.PreTrainedModel,
    root: pathlib.Path,
    prompts: list[list[int]],
    new_tokens: int,
) -> dict[str, tuple[pathlib.Path, list[Reference]]]:
    """Per `SMOLLM2_ADAPTERS` entry (and "base"): the adapter's directory under `root` and HF+PEFT
    float32's greedy tokens and logits of every prompt with that adapter (`new_tokens` long).
    The saved adapters are loaded back into one `PeftModel` and every (adapter, prompt) pair runs
    in one batch, each row through its own adapter or none (PEFT's `adapter_names`, "__base__"
    for none): a decode step reads the base weights once for all. `base` is given back
    unwrapped."""
    import peft

    from tests.workers.paged_runner import hf_greedy_batch

    names = list(SMOLLM2_ADAPTERS)
    for name, spec in SMOLLM2_ADAPTERS.items():
        unwrap(build_adapter(base, root / name, **spec))
    model = peft.PeftModel.from_pretrained(base, str(root / names[0]), adapter_name=names[0])
    try:
        for name in names[1:]:
            model.load_adapter(str(root / name), adapter_name=name)
        rows = [name for name in [*names, "__base__"] for _ in prompts]
        runs = hf_greedy_batch(
            model.eval(), prompts * (len(names) + 1), new_tokens, adapter_names=rows
        )
    finally:
        model.unload()
    out = {
        name: (root / name, runs[index * len(prompts) : (index + 1) * len(prompts)])
        for index, name in enumerate(names)
    }
    out["base"] = (root, runs[len(names) * len(prompts) :])
    return out
