"""The tests' tiny random models: the Llama is built by `benchmarks.tiny_models` (the benchmarks
use it too) and re-exported here under the name every room's tests import; the Qwen3 "thinker"
(a tokenizer with `<think>` tokens and a template that takes `enable_thinking`) is the reasoning
tests' own."""

from __future__ import annotations

import copy
import pathlib

import torch
import transformers

from benchmarks.tiny_models import SEED, TINY_LLAMA_CONFIG, make_tiny_llama, smollm2_tokenizer

__all__ = [
    "QWEN3_STYLE_TEMPLATE",
    "SEED",
    "TINY_LLAMA_CONFIG",
    "make_tiny_llama",
    "make_tiny_qwen3_thinker",
    "smollm2_tokenizer",
]

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
