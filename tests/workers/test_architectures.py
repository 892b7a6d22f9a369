"""Greedy parity with HF transformers for the other family members and every rope scaling rule.

Tiny random models built here: Llama with llama3 rope scaling, Qwen2 (QKV bias, tied embeddings)
with yarn rope, Mistral with a 6-token sliding window and linear rope scaling; prompts longer than
the window and than one block. Tolerance: logits within 1e-4 absolute; tokens identical.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
import transformers

from tests.tiny_model import SEED
from tests.workers.family_parity import assert_greedy_matches_hf, family_group

COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MODELS: dict[str, tuple[type[transformers.PreTrainedModel], type[Any], dict[str, Any]]] = {
    "llama-llama3-rope": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2-bias-yarn": (
        transformers.Qwen2ForCausalLM,
        transformers.Qwen2Config,
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        },
    ),
    "mistral-sliding-window": (
        transformers.MistralForCausalLM,
        transformers.MistralConfig,
        {
            "sliding_window": 6,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        },
    ),
}


def _write_model(name: str, directory: pathlib.Path) -> transformers.PreTrainedModel:
    model_class, config_class, extra = MODELS[name]
    torch.manual_seed(SEED)
    model = model_class(config_class(**COMMON, **extra)).to(torch.float32).eval()
    if name.startswith("qwen2"):
        with torch.no_grad():  # random biases (HF initializes them to zero)
            for layer in model.model.layers:
                for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    projection.bias.normal_(0.0, 0.5)
                layer.self_attn.v_proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_family_member_matches_hf(name: str, tmp_path: pathlib.Path) -> None:
    reference = _write_model(name, tmp_path / name)
    with family_group(tmp_path / name, tmp_path / "cache", num_device_blocks=64) as group:
        prompts = [list(range(3, 20)), [7, 300, 41, 5, 99, 12, 8, 8, 21]]
        assert_greedy_matches_hf(group, reference, prompts, 8, seed=1, prefill_chunk=5)
        expected_window = 6 if name.startswith("mistral") else None
        assert group.model_info.sliding_window == expected_window
