"""Hybrid KV groups through the whole engine: tiny random Gemma 2 (sliding and full layers
alternating), Gemma 3 (five sliding layers to one full) and Mistral (every layer sliding),
windows of 6 and 8 tokens, blocks of 4, prompts and outputs well past the windows.

The oracle is HF transformers' greedy generation with the same weights: the engine's tokens
must equal it with a roomy pool, under preemption by recompute and by swap (a pool small
enough that requests are preempted), from the prefix cache on a second run, and for both
branches of an n=2 request (forked tables, copy-on-write in every group). Every step runs
`check_integrity`; the sliding groups must have handed blocks back (fewer blocks held than
the full layout would) and the pool ends empty.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import pytest
import torch
import transformers

from benchmarks.tiny_models import COMMON, smollm2_tokenizer, write_family_model
from block_manager.hybrid import HybridKVManager
from cluster.engine.config import EngineConfig
from cluster.engine.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.prometheus import render_prometheus
from tests.engine.tiny_engine import assert_all_free, hf_greedy_tokens, tiny_config
from tests.tiny_model import SEED

PROMPTS = [
    [5 + (i * 7) % 300 for i in range(length)] for length in (23, 9, 31, 14, 5, 27)
]  # fmt: skip
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
GROUPS = {"gemma2": 3, "gemma3": 7, "mistral": 1}
"""KV groups of each tiny model: Gemma 2's two sliding layers and one full layer (one layer
per group), Gemma 3's six sliding and one full, Mistral's one sliding group of every layer."""


def _write_mistral(directory: pathlib.Path) -> transformers.PreTrainedModel:
    torch.manual_seed(SEED)
    config = transformers.MistralConfig(**{**COMMON, "sliding_window": 8})
    model = transformers.MistralForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory)
    smollm2_tokenizer().save_pretrained(directory)  # its ids below 512 are the tiny vocab's
    return model


@pytest.fixture(scope="module", params=sorted(GROUPS))
def hybrid_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, pathlib.Path, list[list[int]]]:
    """(name, HF directory, HF's greedy tokens for every prompt)."""
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    if name == "mistral":
        reference = _write_mistral(directory)
    else:
        reference = write_family_model(name, directory)
    reference.generation_config.eos_token_id = None
    expected = [hf_greedy_tokens(reference, prompt, MAX_TOKENS) for prompt in PROMPTS]
    return name, directory, expected


def _config(directory: pathlib.Path, name: str, case: str) -> Any:
    groups = GROUPS[name]
    cache: dict[str, Any] = {"block_size": 4, "num_device_blocks": 400, "num_cpu_blocks": 400}
    scheduler: dict[str, Any] = {}
    if case != "roomy":  # a pool that holds about three of the longest sequences
        cache["num_device_blocks"] = 12 * groups + 4
        scheduler["preemption_mode"] = case
    return tiny_config(directory, cache=cache, scheduler=scheduler)


def _prompts() -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": prompt} for prompt in PROMPTS]


@pytest.mark.parametrize("case", ["roomy", "recompute", "swap"])
def test_hybrid_greedy_matches_hf(
    hybrid_model: tuple[str, pathlib.Path, list[list[int]]], case: str
) -> None:
    name, directory, expected = hybrid_model
    with LLM(config=_config(directory, name, case)) as llm:
        manager = llm.engine.block_manager
        assert isinstance(manager, HybridKVManager)
        assert len(manager.windows) == GROUPS[name]
        outputs = llm.generate(_prompts(), GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        metrics = llm.metrics()
        if case == "recompute":
            assert metrics.preemptions_recompute > 0
        if case == "swap":
            assert metrics.preemptions_swap > 0 and metrics.pressure.swap_in_blocks > 0
        again = llm.generate(_prompts(), GREEDY)
        assert [o.outputs[0].token_ids for o in again] == expected
        if case == "roomy":
            assert sum(o.num_cached_tokens for o in again) > 0
        assert_all_free(llm)


def test_hybrid_forked_branches_match_hf(
    hybrid_model: tuple[str, pathlib.Path, list[list[int]]],
) -> None:
    """n=2 greedy: both branches share the prompt's blocks in every group, then each copies
    its shared tails on its first write; both must give HF's tokens."""
    name, directory, expected = hybrid_model
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    with LLM(config=_config(directory, name, "roomy")) as llm:
        outputs = llm.generate(_prompts()[:3], params)
        for output, tokens in zip(outputs, expected, strict=False):
            assert [branch.token_ids for branch in output.outputs] == [tokens, tokens]
        assert llm.metrics().pressure.cow_copies > 0
        assert_all_free(llm)


def test_sliding_groups_hold_only_their_window(
    hybrid_model: tuple[str, pathlib.Path, list[list[int]]],
) -> None:
    """Midway through a long decode the sliding groups hold about `window / block + 1`
    blocks of the sequence, the full groups all of them."""
    name, directory, _ = hybrid_model
    with LLM(config=_config(directory, name, "roomy")) as llm:
        engine = llm.engine
        manager = engine.block_manager
        assert isinstance(manager, HybridKVManager)
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        engine.add_request(engine.request_builder.build({"prompt_token_ids": PROMPTS[2]}, params))
        for _ in range(20):
            engine.step()
        (seq_id,) = [s for s in range(64) if manager.has_sequence(s)]
        tables = manager.group_tables(seq_id)
        length = manager.num_tokens(seq_id)
        for window, table in zip(manager.windows, tables, strict=True):
            held = sum(block != manager.null_block for block in table)
            if window is None:
                assert held == len(table) == -(-length // 4)
            else:
                assert held <= window // 4 + 2 < len(table)


def test_group_blocks_in_metrics_and_prometheus(
    hybrid_model: tuple[str, pathlib.Path, list[list[int]]],
) -> None:
    """Each group's used and cached blocks add up to the device tier's; `/metrics` renders
    one sample per group and state."""
    name, directory, _ = hybrid_model
    with LLM(config=_config(directory, name, "roomy")) as llm:
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        engine.add_request(engine.request_builder.build({"prompt_token_ids": PROMPTS[2]}, params))
        for _ in range(10):
            engine.step()
        metrics = llm.metrics()
        groups, device = metrics.kv_groups, metrics.pressure.device
        assert [usage.group for usage in groups] == list(range(GROUPS[name]))
        assert sum(usage.used for usage in groups) == device.used > 0
        assert sum(usage.cached for usage in groups) == device.evictable_cached
        assert {usage.free for usage in groups} == {device.free}
        text = render_prometheus({"r0": metrics}).decode()
        window = "full" if groups[0].window is None else str(groups[0].window)
        line = (
            f'pagedserve_kv_cache_group_blocks{{group="0",replica="r0",state="used",'
            f'window="{window}"}} {float(groups[0].used)}'
        )
        assert line in text


def test_disable_flag_keeps_every_layer_and_the_same_tokens(
    hybrid_model: tuple[str, pathlib.Path, list[list[int]]],
) -> None:
    """vLLM's `--disable-hybrid-kv-cache-manager` parses to the cache setting and gives the
    full layout (one table, every layer's blocks), with the same greedy tokens."""
    name, directory, expected = hybrid_model
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(["--model", str(directory), "--disable-hybrid-kv-cache-manager"])
    assert EngineConfig.from_cli_args(args).cache.disable_hybrid_kv_cache_manager
    config = _config(directory, name, "roomy")
    config.cache.disable_hybrid_kv_cache_manager = True
    with LLM(config=config) as llm:
        assert not isinstance(llm.engine.block_manager, HybridKVManager)
        assert llm.engine.model_info.kv_group_windows == ()
        outputs = llm.generate(_prompts()[:2], GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == expected[:2]


def test_range_layouts_refuse_hybrid_groups(
    hybrid_model: tuple[str, pathlib.Path, list[list[int]]],
) -> None:
    """A contiguous layout keeps every layer's blocks: a sliding-window model is refused
    there unless the flag says so, naming the flag."""
    _, directory, _ = hybrid_model
    config = tiny_config(directory, cache={"kv_layout": "contiguous", "num_cpu_blocks": 0})
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager"):
        LLM(config=config)
    config.cache.disable_hybrid_kv_cache_manager = True
    with LLM(config=config) as llm:
        assert llm.engine.kv_layout.name == "contiguous"
