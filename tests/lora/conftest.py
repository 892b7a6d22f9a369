"""Fixtures of the LoRA tests: PEFT adapters built on the tiny Llama (HF float32 oracle), each
saved with PEFT's `save_pretrained` and loaded back into a fresh `PeftModel` as the oracle."""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers

from tests.lora.adapters import ALL_PROJECTIONS, Reference, build_adapter, peft_greedy_references

SMOLLM2_CHATS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
]
"""The SmolLM2 LoRA parity tests' user messages (each test takes a leading slice)."""
SMOLLM2_NEW_TOKENS = 16
"""HF+PEFT's greedy references are this long; a test wanting fewer takes their leading part
(greedy decoding's first n tokens and logits do not depend on how many follow)."""
SmolLM2References = dict[str, tuple[pathlib.Path, list[Reference]]]


@pytest.fixture(scope="session")
def tiny_adapters(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: pathlib.Path
) -> dict[str, pathlib.Path]:
    """Three adapters of the tiny model: `all8` (rank 8, all seven projections), `qv16` (rank
    16, q/v only) and `rs4` (rank 4 on o/down, rsLoRA scaling)."""
    root = tmp_path_factory.mktemp("tiny_adapters")
    specs = {
        "all8": {"rank": 8, "targets": ALL_PROJECTIONS, "seed": 1},
        "qv16": {"rank": 16, "targets": ("q_proj", "v_proj"), "seed": 2},
        "rs4": {"rank": 4, "targets": ("o_proj", "down_proj"), "seed": 3, "use_rslora": True},
    }
    paths = {}
    for name, spec in specs.items():
        base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        build_adapter(base, root / name, **spec)  # type: ignore[arg-type]
        paths[name] = root / name
    return paths


def peft_oracle(model_dir: pathlib.Path, adapter: pathlib.Path) -> transformers.PreTrainedModel:
    """HF transformers float32 + PEFT with the saved adapter: the reference model."""
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base.eval(), str(adapter)).eval()


@pytest.fixture(scope="session")
def smollm2_peft_references(
    smollm2_hf: transformers.PreTrainedModel, tmp_path_factory: pytest.TempPathFactory
) -> SmolLM2References:
    """Per `SMOLLM2_ADAPTERS` entry (and "base"): the adapter's directory and HF+PEFT float32's
    greedy tokens and logits for every `SMOLLM2_CHATS` prompt, `SMOLLM2_NEW_TOKENS` long."""
    from tests.workers.paged_runner import chat_prompt_ids
    from workers import load_tokenizer

    prompts = chat_prompt_ids(load_tokenizer("default"), SMOLLM2_CHATS)
    root = tmp_path_factory.mktemp("smollm2_adapters")
    return peft_greedy_references(smollm2_hf, root, prompts, SMOLLM2_NEW_TOKENS)
