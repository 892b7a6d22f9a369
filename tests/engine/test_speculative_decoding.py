"""Speculative decoding (n-gram prompt lookup): the tokens are the ones plain decoding produces.

The oracle is the same engine with speculation off: every case compares token ids, text, finish
reasons and log-probabilities with it, greedy and seeded, under the memory regimes that move KV
around (recompute, swap, chunked prefill, prefix hits) and with parallel sampling and stops.
Counters show that drafts were both accepted and rejected, so both paths of `truncate` ran.
The n-gram index is checked against a brute-force search (Hypothesis).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from block_manager import CacheKey, InvalidOperation
from cluster.engine.config import EngineConfig, SpeculativeSettings
from cluster.engine.errors import ConfigError
from cluster.engine.llm import LLM, config_from_kwargs
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.speculation import NgramIndex, NgramSpeculator, SpeculationCounters
from cluster.serving.cli_serve import apply_speculative_flag
from kv_layouts.contiguous import ContiguousKVManager
from tests.block_manager.helpers import SEED, make_manager, prefill
from tests.engine.tiny_engine import PROMPTS, assert_all_free, tiny_config
from workers.batch import PackedBatch, SequenceRegistry, pack_batch
from workers.plan import PlanRejected, SamplingSettings, SequenceWork, StepPlan

NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
REPEATING = [
    "1 2 3 1 2 3 1 2 3 1 2 3 1 2",
    "the cat sat on the mat, the cat sat on the",
    "ab ab ab ab ab ab ab ab ab ab",
]
"""Prompts whose own n-grams give drafts from the first decode."""


def _run(
    config: EngineConfig, prompts: list[str], params: SamplingParams
) -> tuple[list[Any], SpeculationCounters | None]:
    with LLM(config=config) as llm:
        outputs = llm.generate(prompts, params)
        metrics = llm.metrics()
        assert_all_free(llm)
    return [_visible(o) for o in outputs], metrics.speculation


def _visible(output: RequestOutput) -> list[tuple[Any, ...]]:
    """What a client sees of a request: per branch its tokens, text, finish and logprobs."""
    return [
        (
            c.token_ids,
            c.text,
            c.finish_reason,
            c.stop_reason,
            None
            if c.logprobs is None
            else [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs],
        )
        for c in output.outputs
    ]


CASES: dict[str, tuple[dict[str, dict[str, Any]], SamplingParams]] = {
    "greedy": ({}, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
    "seeded": (
        {},
        SamplingParams(temperature=1.0, top_k=2, seed=5, max_tokens=40, ignore_eos=True),
    ),
    "logprobs": ({}, SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True)),
    "parallel": (
        {},
        SamplingParams(n=3, temperature=1.0, top_k=2, seed=11, max_tokens=24, ignore_eos=True),
    ),
    "max_tokens_2": ({}, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)),
    "recompute": (
        {
            "cache": {"num_device_blocks": 16, "block_size": 4},
            "scheduler": {"preemption_mode": "recompute"},
        },
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
    ),
    "swap": (
        {
            "cache": {"num_device_blocks": 16, "block_size": 4},
            "scheduler": {"preemption_mode": "swap"},
        },
        SamplingParams(temperature=1.0, top_k=2, seed=3, max_tokens=32, ignore_eos=True),
    ),
    "chunked": (
        {"scheduler": {"max_num_batched_tokens": 8, "max_num_seqs": 4}},
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ),
    "row_cap": (
        {"speculative": {"speculative_max_rows": 6}},
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tokens_equal_plain_decoding(tiny_model_dir: pathlib.Path, case: str) -> None:
    sections, params = CASES[case]
    prompts = PROMPTS + REPEATING
    plain, none = _run(tiny_config(tiny_model_dir, **sections), prompts, params)
    spec_sections = {**sections, "speculative": {**NGRAM, **sections.get("speculative", {})}}
    fast, counters = _run(tiny_config(tiny_model_dir, **spec_sections), prompts, params)
    assert none is None and counters is not None
    assert fast == plain
    if case != "max_tokens_2":
        assert counters.num_draft_tokens > counters.num_accepted_tokens > 0, counters
    assert sum(counters.accepted_per_position) == counters.num_accepted_tokens


def test_stops_inside_accepted_drafts(tiny_model_dir: pathlib.Path) -> None:
    """A stop string or stop token met inside a step's accepted tokens ends the branch there:
    the tokens the same step accepted after it are dropped, as plain decoding never samples
    them."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _ = _run(tiny_config(tiny_model_dir), REPEATING, greedy)
    for prompt, (branch,) in zip(REPEATING, plain, strict=True):
        text = branch[1]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        if not stop.strip():
            continue
        token = branch[0][len(branch[0]) // 2]
        for params in (
            dataclasses.replace(greedy, stop=[stop]),
            dataclasses.replace(greedy, stop_token_ids=[token]),  # checked as EOS is
        ):
            expected, _ = _run(tiny_config(tiny_model_dir), [prompt], params)
            spec = tiny_config(tiny_model_dir, speculative=NGRAM)
            got, _ = _run(spec, [prompt], params)
            assert got == expected and got[0][0][2] == "stop"


def test_prefix_hits_give_the_same_tokens(tiny_model_dir: pathlib.Path) -> None:
    """A second run of the same prompts starts from cached blocks that earlier drafts helped
    fill (only accepted tokens are ever sealed): the tokens stay plain decoding's."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _ = _run(tiny_config(tiny_model_dir), REPEATING, params)
    with LLM(config=tiny_config(tiny_model_dir, speculative=NGRAM)) as llm:
        first = llm.generate(REPEATING, params)
        again = llm.generate(REPEATING, params)
        assert_all_free(llm)
    assert [_visible(o) for o in first] == [_visible(o) for o in again] == plain
    assert all(o.num_cached_tokens > 0 for o in again)


def test_drafts_stay_within_max_model_len(tiny_model_dir: pathlib.Path) -> None:
    """Drafts never reach past the model's length: the last rows stop at it."""
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    config = tiny_config(tiny_model_dir, model={"max_model_len": 48})
    plain, _ = _run(config, REPEATING, params)
    spec = tiny_config(tiny_model_dir, model={"max_model_len": 48}, speculative=NGRAM)
    fast, counters = _run(spec, REPEATING, params)
    assert fast == plain and counters.num_accepted_tokens > 0
    assert all(branch[2] == "length" for (branch,) in fast)


# --- the n-gram index ------------------------------------------------------------------------


def brute_force_proposal(tokens: list[int], count: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix n-gram's latest earlier occurrence, continued (into itself)."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if length < n:
            continue
        suffix = tokens[length - n :]
        ends = [e for e in range(n, length) if tokens[e - n : e] == suffix]
        if ends:
            extended = list(tokens)
            for offset in range(count):
                extended.append(extended[ends[-1] + offset])
            return extended[length:]
    return []


@settings(deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 40), max_size=4),
    count=st.integers(1, 6),
    sizes=st.tuples(st.integers(1, 3), st.integers(0, 2)),
)
def test_ngram_index_matches_brute_force(
    tokens: list[int], cuts: list[int], count: int, sizes: tuple[int, int]
) -> None:
    """Fed incrementally (as a branch grows), the index proposes what a full search would."""
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    index = NgramIndex(min_n, max_n)
    for cut in [*sorted(c for c in cuts if c < len(tokens)), len(tokens)]:
        prefix = tokens[:cut]
        assert index.propose(prefix, count) == brute_force_proposal(prefix, count, min_n, max_n)


def test_ngram_index_continues_a_loop_past_the_context() -> None:
    index = NgramIndex(1, 3)
    assert index.propose([7, 8, 9, 7, 8, 9, 7], 5) == [8, 9, 7, 8, 9]
    assert index.propose([1, 2, 3], 3) == []  # nothing repeats
    assert index.propose([1, 2, 3, 4], 0) == []


def test_allowance_shares_the_row_cap() -> None:
    settings_ = SpeculativeSettings(
        speculative_method="ngram", num_speculative_tokens=3, speculative_max_rows=8
    )
    speculator = NgramSpeculator(settings_)

    def drafts(decodes: int) -> list[int]:
        allowance = speculator.allowance(decodes)
        return [allowance.next() for _ in range(decodes)]

    assert drafts(1) == [3] and drafts(2) == [3, 3]
    assert drafts(3) == [2, 2, 1]  # 5 spare rows
    assert drafts(4) == [1, 1, 1, 1] and drafts(8) == [0] * 8 and drafts(12) == [0] * 12
    capped = NgramSpeculator(settings_.model_copy(update={"speculative_disable_by_batch_size": 2}))
    assert capped.allowance(1).next() == 3 and capped.allowance(2).next() == 0
    unlimited = NgramSpeculator(settings_.model_copy(update={"speculative_max_rows": None}))
    assert unlimited.allowance(40).next() == 3


def test_accept_counts_the_confirmed_prefix() -> None:
    speculator = NgramSpeculator(SpeculativeSettings(speculative_method="ngram"))
    assert speculator.accept([5, 6, 7], [5, 6, 9, 1]) == 2
    assert speculator.accept([5, 6, 7], [4, 6, 7, 1]) == 0
    assert speculator.accept([5], [5, 2]) == 1
    counters = speculator.counters
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (
        3,
        7,
        3,
    )
    assert counters.accepted_per_position == [2, 1, 0]


# --- the block manager's truncate --------------------------------------------------------------


def test_truncate_releases_the_draft_blocks_and_resyncs_the_workers() -> None:
    manager = make_manager(device=8, block_size=4)
    prefill(manager, 1, [1, 2, 3, 4, 5, 6])
    manager.take_table_delta(1)
    free = manager.num_free_device_blocks()
    for token in (7, 8, 9, 10, 11):  # the pending token, then four drafts: one new block
        manager.append_token(1, token)
    assert manager.num_free_device_blocks() == free - 1
    table = manager.block_table(1)
    assert manager.take_table_delta(1) == (2, [table[2]])
    manager.truncate(1, 8)  # the pending token and one draft accepted
    manager.mark_computed(1, 8)
    assert manager.block_table(1) == table[:2]
    assert manager.token_ids(1) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert manager.num_free_device_blocks() == free
    assert manager.take_table_delta(1) == (2, [])
    manager.append_token(1, 12)  # the next token gets a block again
    assert len(manager.block_table(1)) == 3
    manager.check_integrity()


def test_truncate_refuses_computed_tokens_and_changes_nothing() -> None:
    manager = make_manager(device=8, block_size=4)
    prefill(manager, 1, [1, 2, 3, 4, 5, 6])
    manager.append_token(1, 7)
    for bad in (5, 0, 8, 7.0):
        with pytest.raises(InvalidOperation):
            manager.truncate(1, bad)  # type: ignore[arg-type]
    assert manager.token_ids(1) == [1, 2, 3, 4, 5, 6, 7]
    manager.truncate(1, 6)
    assert manager.num_tokens(1) == 6
    with pytest.raises(InvalidOperation):
        manager.truncate(99, 1)
    manager.check_integrity()


def test_truncate_on_a_range_layout_keeps_the_run() -> None:
    manager = ContiguousKVManager(num_device_blocks=16, block_size=4, max_model_len=32)
    manager.allocate(1, [1, 2, 3], CacheKey(SEED))
    manager.mark_computed(1, 3)
    table = manager.block_table(1)
    for token in (4, 5, 6, 7):
        manager.append_token(1, token)
    manager.truncate(1, 5)
    assert manager.token_ids(1) == [1, 2, 3, 4, 5]
    assert manager.block_table(1)[: len(table)] == table
    with pytest.raises(InvalidOperation):
        manager.truncate(1, 2)
    manager.check_integrity()


# --- configuration -----------------------------------------------------------------------------


def test_vllm_speculative_config_maps_to_the_section() -> None:
    config = config_from_kwargs(
        None,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 5,
            "prompt_lookup_min": 2,
            "disable_by_batch_size": 6,
            "max_rows": 10,
        },
    )
    assert config.speculative == SpeculativeSettings(
        speculative_method="ngram",
        num_speculative_tokens=4,
        prompt_lookup_max=5,
        prompt_lookup_min=2,
        speculative_disable_by_batch_size=6,
        speculative_max_rows=10,
    )
    with pytest.raises(ConfigError, match="unknown keys"):
        config_from_kwargs(None, speculative_config={"method": "ngram", "draft_model": "x"})
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        config_from_kwargs(None, speculative_config={"method": "ngram", "prompt_lookup_min": 5})
    with pytest.raises(ConfigError, match="speculative_method"):
        config_from_kwargs(None, speculative_config={"method": "eagle"})


def test_cli_flags_set_speculation() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    config = EngineConfig.from_cli_args(args)
    assert config.speculative.speculative_method == "ngram"
    assert config.speculative.num_speculative_tokens == 2
    with pytest.raises(ConfigError, match="not JSON"):
        EngineConfig.from_cli_args(parser.parse_args(["--speculative-config", "{method"]))
    off = parser.parse_args(["--speculative-config", "none"])
    assert EngineConfig.from_cli_args(off).speculative.speculative_method is None
    flags = parser.parse_args(["--speculative-method", "ngram", "--speculative-max-rows", "8"])
    assert EngineConfig.from_cli_args(flags).speculative.speculative_max_rows == 8


def test_serve_flag_replaces_or_removes_the_section() -> None:
    config: dict[str, Any] = {
        "applications": [{"args": {"engine": {"speculative": {"speculative_method": "ngram"}}}}]
    }
    apply_speculative_flag(config, '{"method": "ngram", "max_rows": 4}')
    engine = config["applications"][0]["args"]["engine"]
    assert engine["speculative"] == {"speculative_method": "ngram", "speculative_max_rows": 4}
    apply_speculative_flag(config, "none")
    assert "speculative" not in engine
    with pytest.raises(ConfigError):
        apply_speculative_flag(config, "[1, 2")


# --- the workers' packing ----------------------------------------------------------------------


def _packed(work: SequenceWork) -> PackedBatch:
    registry = SequenceRegistry()
    plan = StepPlan(1, [work])
    registry.apply(plan)
    return pack_batch(plan, registry, 4, torch.device("cpu"))


def test_a_speculative_work_packs_as_one_decode_per_position() -> None:
    settings_ = SamplingSettings(temperature=0.0)
    work = SequenceWork(
        7, [40, 41, 42, 43], 2, 0, [3, 9], num_samples=1, num_draft_tokens=3, output_index=2
    )
    work.sampling = settings_
    batch = _packed(work)
    meta = batch.metadata
    assert batch.token_ids.tolist() == [40, 41, 42, 43]
    assert meta.positions.tolist() == [2, 3, 4, 5]
    assert meta.slot_mapping.tolist() == [14, 15, 36, 37]  # blocks 3 then 9, 4 slots each
    assert meta.cu_query_lens.tolist() == [0, 1, 2, 3, 4]
    assert meta.context_lens.tolist() == [3, 4, 5, 6]
    assert meta.block_tables.tolist() == [[3, 0], [3, 0], [3, 9], [3, 9]]  # padded to 2
    assert meta.logits_indices.tolist() == [0, 1, 2, 3]
    assert batch.sample_seq_ids == [7, 7, 7, 7]
    assert [r.output_index for r in batch.sample_requests] == [2, 3, 4, 5]
    assert all(r.num_samples == 1 for r in batch.sample_requests)


@pytest.mark.parametrize(
    ("tokens", "drafts", "samples"), [([1, 2], 2, 1), ([1, 2, 3], 1, 0), ([1, 2, 3], 1, 2)]
)
def test_bad_draft_counts_are_refused(tokens: list[int], drafts: int, samples: int) -> None:
    work = SequenceWork(7, tokens, 2, 0, [3, 9], num_samples=samples, num_draft_tokens=drafts)
    work.sampling = SamplingSettings()
    with pytest.raises(PlanRejected, match="drafts"):
        _packed(work)
