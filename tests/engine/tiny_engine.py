"""Shared pieces of the tiny-Llama engine tests: prompts, greedy params, the config builder and
HF's greedy tokens as the oracle."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from cluster.engine.config import EngineConfig
from cluster.engine.llm import LLM
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Paged attention stores the KV cache in blocks so that",
    "1 2 3",
    "A much longer prompt that spans several blocks of the cache, written so that chunked "
    "prefill and preemption have real work to do when the pool is small.",
    "Hello",
    "Once upon a time, in a land far away,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PREEMPTING: dict[str, dict[str, dict[str, Any]]] = {
    "recompute": {
        "cache": {"num_device_blocks": 16, "block_size": 4},
        "scheduler": {"preemption_mode": "recompute"},
    },
    "swap": {
        "cache": {"num_device_blocks": 16, "block_size": 4},
        "scheduler": {"preemption_mode": "swap"},
    },
}
"""Config sections of a pool of 16 blocks of 4 that preempts by recompute or by swap."""


def tiny_config(model_dir: pathlib.Path, **sections: dict[str, Any]) -> EngineConfig:
    base: dict[str, dict[str, Any]] = {
        "model": {"model": str(model_dir), "dtype": "float32"},
        "cache": {"block_size": 8, "num_device_blocks": 200, "num_cpu_blocks": 64, "watermark": 0},
        "parallel": {"backend": "local"},
        "scheduler": {"check_integrity": True, "max_num_seqs": 8, "max_num_batched_tokens": 256},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return EngineConfig.build(base)


def greedy_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_free(llm: LLM) -> None:
    pressure = llm.engine.block_manager.pressure()
    assert pressure.device.used == 0 and pressure.cpu.used == 0
    assert llm.engine.block_manager.num_free_device_blocks() == pressure.device.total


def hf_greedy_tokens(
    model: Any,
    prompt_ids: list[int],
    max_tokens: int,
    processors: Sequence[LogitsProcessor] = (),
    stop_ids: Sequence[int] = (),
) -> list[int]:
    """HF transformers' greedy `generate` over `prompt_ids` with `processors` (the oracle of the
    sampling tests): `max_tokens` new tokens, fewer only when one of `stop_ids` is drawn."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=list(stop_ids) or None,
            pad_token_id=0,
            logits_processor=LogitsProcessorList(processors),
        )
    return out[0, ids.shape[1] :].tolist()


class MemoizedOracle:
    """An oracle that answers each question once: the regime tests ask HF the same question
    (a prompt and its sampling parameters) under every engine regime, and HF's answer depends on
    neither the regime nor what was asked before. Questions are keyed by their `repr`."""

    def __init__(self, answer: Callable[..., Any]) -> None:
        self._answer = answer
        self._answers: dict[str, Any] = {}

    def __call__(self, *question: Any) -> Any:
        key = repr(question)
        if key not in self._answers:
            self._answers[key] = self._answer(*question)
        return self._answers[key]
