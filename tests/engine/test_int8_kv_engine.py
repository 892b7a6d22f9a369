"""An int8 KV cache (`cache.kv_cache_dtype: int8`) through the whole engine on the tiny Llama:
the scales travel with the codes through swap, the CPU cache tier and prefix sharing (the same
greedy tokens as the roomy int8 run, where nothing moves), and the KV dtype is part of the cache
identity (a block hashed under one dtype never serves a request of another)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from cluster.engine.llm import LLM
from tests.engine.tiny_engine import (
    GREEDY,
    PREEMPTING,
    PROMPTS,
    assert_all_free,
    greedy_ids,
    tiny_config,
)

INT8: dict[str, Any] = {"kv_cache_dtype": "int8"}


def _int8_config(model_dir: pathlib.Path, **sections: dict[str, Any]):
    cache = {**sections.pop("cache", {}), **INT8}
    return tiny_config(model_dir, cache=cache, **sections)


@pytest.fixture(scope="module")
def roomy_int8(tiny_model_dir: pathlib.Path) -> list[list[int]]:
    with LLM(config=_int8_config(tiny_model_dir)) as llm:
        assert llm.engine.workers.local_rank.device_pool.dtype == torch.int8
        return greedy_ids(llm.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("case", ["swap", "recompute"])
def test_int8_greedy_identical_when_blocks_move(
    tiny_model_dir: pathlib.Path, roomy_int8: list[list[int]], case: str
) -> None:
    with LLM(config=_int8_config(tiny_model_dir, **PREEMPTING[case])) as llm:
        assert greedy_ids(llm.generate(PROMPTS, GREEDY)) == roomy_int8
        metrics = llm.metrics()
        if case == "swap":
            assert metrics.preemptions_swap >= 2 and metrics.pressure.swap_in_blocks > 0
        again = llm.generate(PROMPTS, GREEDY)  # served from the prefix cache this time
        assert greedy_ids(again) == roomy_int8
        assert sum(o.num_cached_tokens for o in again) > 0
        assert_all_free(llm)


def test_kv_dtype_is_part_of_the_cache_identity(tiny_model_dir: pathlib.Path) -> None:
    prompt = {"prompt_token_ids": list(range(100, 140))}
    hashes = {}
    for kv_cache_dtype in ("auto", "int8"):
        config = tiny_config(tiny_model_dir, cache={"kv_cache_dtype": kv_cache_dtype})
        with LLM(config=config) as llm:
            core = llm.engine
            request = core.request_builder.build(prompt, GREEDY)
            hashes[kv_cache_dtype] = core.request_keys.block_hashes(request)
            assert core.model_info.kv_cache_dtype == kv_cache_dtype
    assert hashes["auto"] and hashes["int8"]
    assert not set(hashes["auto"]) & set(hashes["int8"])
