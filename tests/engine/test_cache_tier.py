"""The CPU cache tier on the tiny model: same greedy tokens with it on and off, hits served from
the CPU tier, and a corrupted CPU block caught by its checksum instead of served."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from cluster.engine.errors import RequestFailed
from cluster.engine.llm import LLM
from cluster.engine.outputs import RequestOutput
from tests.engine.tiny_engine import GREEDY, PROMPTS, assert_all_free, greedy_ids, tiny_config

SMALL_POOL: dict[str, Any] = {"num_device_blocks": 16, "block_size": 4, "verify_swaps": True}


def _two_rounds(model_dir: pathlib.Path, cpu_cache: bool) -> tuple[LLM, list[RequestOutput]]:
    llm = LLM(config=tiny_config(model_dir, cache={**SMALL_POOL, "cpu_cache": cpu_cache}))
    outputs = llm.generate(PROMPTS, GREEDY) + llm.generate(PROMPTS, GREEDY)
    return llm, outputs


def test_greedy_identical_with_the_tier_on_and_off(
    tiny_model_dir: pathlib.Path, roomy_outputs: list[RequestOutput]
) -> None:
    off, off_outputs = _two_rounds(tiny_model_dir, cpu_cache=False)
    with off:
        off_tier = off.metrics().cache_tier
        assert off_tier.demoted_blocks == off_tier.cpu_hit_tokens == 0
        assert_all_free(off)
    on, on_outputs = _two_rounds(tiny_model_dir, cpu_cache=True)
    with on:
        metrics = on.metrics()
        tier = metrics.cache_tier
        assert tier.demoted_blocks > 0 and tier.promoted_blocks > 0
        assert tier.cpu_hit_tokens > 0 and metrics.kv_bytes_to_device > 0
        assert metrics.swap_checksum_failures == 0 and tier.refused_swap_ins == 0
        assert_all_free(on)
    expected = greedy_ids(roomy_outputs) * 2
    assert greedy_ids(off_outputs) == expected
    assert greedy_ids(on_outputs) == expected
    assert sum(o.num_cached_tokens for o in on_outputs) > sum(
        o.num_cached_tokens for o in off_outputs
    )


def test_a_corrupted_cpu_block_fails_the_request_and_is_counted(
    tiny_model_dir: pathlib.Path, roomy_outputs: list[RequestOutput]
) -> None:
    prompt, others = PROMPTS[3], [p for i, p in enumerate(PROMPTS) if i != 3]
    expected = greedy_ids(roomy_outputs)[3]
    with LLM(config=tiny_config(tiny_model_dir, cache=SMALL_POOL)) as llm:
        assert greedy_ids(llm.generate([prompt], GREEDY)) == [expected]
        llm.generate(others, GREEDY)  # pushes the prompt's blocks out to the CPU tier
        engine = llm.engine
        assert engine.metrics().cache_tier.demoted_blocks > 0
        rank = engine.workers._local
        assert rank is not None and rank.cpu_pool is not None
        rank.cpu_pool.add_(1.0)  # every CPU block's bytes change behind the tier's back
        with pytest.raises(RequestFailed, match="failed their checksum"):
            llm.generate([prompt], GREEDY)
        metrics = engine.metrics()
        assert metrics.swap_checksum_failures > 0
        # The bad blocks were dropped from both tiers: the prompt is recomputed, right.
        assert greedy_ids(llm.generate([prompt], GREEDY)) == [expected]
        assert_all_free(llm)


@pytest.mark.smollm2
def test_smollm2_greedy_identical_with_the_tier_on_and_off() -> None:
    """The shipped model under a device pool too small for its prompts' histories: the same
    greedy tokens whether evicted prefixes are demoted to and promoted from the CPU tier or
    recomputed, and the tier really served hits."""
    from pagedserve import SamplingParams

    topics = ["rivers", "mountains", "engines", "gardens", "music", "numbers"]
    prompts = [
        f"Notes on {topic}: "
        + " ".join(f"{topic} fact {n} is worth keeping." for n in range(12))
        + f" Question: what do you know about {topic}?"
        for topic in topics
    ]  # each about 9 blocks of 16: together more than the 40-block device pool
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for cpu_cache in (False, True):
        settings = {"num_device_blocks": 40, "block_size": 16, "verify_swaps": True}
        with LLM(max_model_len=256, cpu_cache=cpu_cache, **settings) as llm:
            first = llm.generate(prompts, params)
            again = llm.generate(prompts[::-1], params)[::-1]  # histories left the device pool
            tier = llm.metrics().cache_tier
            assert (tier.cpu_hit_tokens > 0) == cpu_cache
            assert_all_free(llm)
        results[cpu_cache] = [o.outputs[0].token_ids for o in first + again]
    assert results[True] == results[False]
