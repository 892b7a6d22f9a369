"""`scheduler.async_scheduling`: the next step runs while the last one's text, stop strings and
outputs are done, and nothing a client sees changes.

Oracles: the same engine with the knob off (token for token, text, finish and stop reasons,
log-probabilities), `reference_tokens` (the slot simulator's tokens with no paging at all) and
a block manager whose every block is free once everything ended. That the overlap happens is
shown by the workers: a branch a stop string ends had one more token computed (and dropped).
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
from typing import Any

import pytest

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.config import EngineConfig
from cluster.engine.llm import LLM
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from tests.engine.slot_workers import SlotWorkers, reference_tokens
from tests.engine.streams import engine_outputs
from tests.engine.test_speculative_decoding import REPEATING
from tests.engine.test_structured_outputs import PRESSURE, _constrained, _valid_json
from tests.engine.test_structured_outputs import PROMPTS as STRUCTURED_PROMPTS
from tests.engine.tiny_engine import GREEDY, PREEMPTING, PROMPTS, assert_all_free, tiny_config

MEMORY = {"roomy": {}, **PREEMPTING}


def summary(outputs: list[RequestOutput]) -> list[list[tuple[Any, ...]]]:
    """Everything a client sees of each branch."""
    return [
        [
            (
                c.token_ids,
                c.text,
                c.finish_reason,
                c.stop_reason,
                None if c.logprobs is None else [(lp.token_id, lp.logprob) for lp in c.logprobs],
            )
            for c in o.outputs
        ]
        for o in outputs
    ]


def stop_cases(roomy: list[RequestOutput]) -> list[SamplingParams]:
    """Per prompt: greedy with a stop string taken from the middle of its greedy text, a stop
    token id from the middle of its greedy tokens, seeded parallel sampling with logprobs,
    uneven `max_tokens`."""
    text = roomy[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stop_id = roomy[1].outputs[0].token_ids[6]
    return [
        dataclasses.replace(GREEDY, stop=[stop]),
        dataclasses.replace(GREEDY, stop_token_ids=[stop_id]),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, logprobs=2),
        dataclasses.replace(GREEDY, max_tokens=3),
        SamplingParams(temperature=0.8, seed=11, max_tokens=20, stop=[stop]),
        dataclasses.replace(GREEDY, max_tokens=1),
    ]


@pytest.mark.parametrize("memory", sorted(MEMORY))
def test_offline_outputs_are_identical_with_and_without_overlap(
    tiny_model_dir: pathlib.Path, roomy_outputs: list[RequestOutput], memory: str
) -> None:
    params = stop_cases(roomy_outputs)
    results = {}
    for overlap in (False, True):
        sections = {k: dict(v) for k, v in MEMORY[memory].items()}
        sections.setdefault("scheduler", {})["async_scheduling"] = overlap
        with LLM(config=tiny_config(tiny_model_dir, **sections)) as llm:
            results[overlap] = summary(llm.generate(PROMPTS, params))
            if memory != "roomy":
                metrics = llm.metrics()
                assert metrics.preemptions_recompute + metrics.preemptions_swap > 0
            assert_all_free(llm)
    assert results[True] == results[False]
    finishes = [branch[2:4] for output in results[True] for branch in output]
    assert ("stop", stop_cases(roomy_outputs)[0].stop[0]) in finishes  # the cases do stop
    assert ("stop", stop_cases(roomy_outputs)[1].stop_token_ids[0]) in finishes


def slot_config(**scheduler: Any) -> EngineConfig:
    return EngineConfig().with_overrides(
        {
            "cache": {"block_size": 4, "watermark": 0.0},
            "scheduler": {"check_integrity": True, "max_num_seqs": 8, **scheduler},
            "parallel": {"backend": "local"},
        }
    )


def slot_prompts() -> list[list[int]]:
    return [[400 + 13 * i + t for t in range(3 + 5 * i)] for i in range(8)]


async def serve(
    overlap: bool,
    params: list[SamplingParams],
    *,
    num_device_blocks: int = 64,
    abort_after: int | None = None,
    **scheduler: Any,
) -> tuple[list[RequestOutput], SlotWorkers]:
    """Every prompt through an AsyncEngine over SlotWorkers at once; with `abort_after`, the
    last request is aborted once it has that many tokens. Checks every block came back."""
    workers = SlotWorkers(
        num_device_blocks=num_device_blocks, num_cpu_blocks=64, block_size=4, max_model_len=256
    )
    config = slot_config(async_scheduling=overlap, **scheduler)
    engine = AsyncEngine(config, workers)  # type: ignore[arg-type]
    build = engine.request_builder.build
    prompts = slot_prompts()

    async def run(index: int) -> RequestOutput:
        request = build({"prompt_token_ids": prompts[index]}, params[index], request_id=f"r{index}")
        last = None
        async for output in engine_outputs(engine, request):
            last = output
            tokens = len(output.outputs[0].token_ids)
            aborting = abort_after is not None and index == len(prompts) - 1
            if aborting and tokens >= (abort_after or 0) and not output.finished:
                await engine.abort(request.request_id or "")
        assert last is not None and last.finished
        return last

    outputs = await asyncio.gather(*(run(i) for i in range(len(prompts))))
    bm = engine.core.block_manager
    assert bm.num_free_device_blocks() == bm.num_device_blocks
    assert bm.pressure().device.used == 0 and bm.pressure().cpu.used == 0
    await engine.shutdown()
    return list(outputs), workers


def slot_params() -> list[SamplingParams]:
    """EOS on (the simulator ends one token in 29 with it), greedy and seeded, n=1 and 2."""
    return [
        SamplingParams(temperature=0.0, max_tokens=40)
        if i % 2 == 0
        else SamplingParams(n=1 + i % 3 // 2, temperature=1.0, seed=i, max_tokens=30 + i)
        for i in range(8)
    ]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_served_outputs_match_the_reference_under_preemption(preemption_mode: str) -> None:
    params = slot_params()
    results = {}
    for overlap in (False, True):
        outputs, _ = asyncio.run(
            serve(overlap, params, num_device_blocks=24, preemption_mode=preemption_mode)
        )
        results[overlap] = summary(outputs)
        prompts = slot_prompts()
        for output, p, prompt in zip(outputs, params, prompts, strict=True):
            settings = p.to_settings(p.seed if p.seed is not None else 0)
            for branch in output.outputs:
                expected = reference_tokens(
                    prompt, settings, branch_index=branch.index, max_tokens=p.max_tokens or 0
                )
                assert branch.token_ids == expected
    assert results[True] == results[False]
    reasons = {b[2] for o in results[True] for b in o}
    assert reasons == {"stop", "length"}  # EOS and max_tokens both ended branches


def test_a_late_stop_string_drops_the_token_computed_meanwhile() -> None:
    plain = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 8
    reference, _ = asyncio.run(serve(False, plain))
    text = reference[2].outputs[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 2]
    stopping = [dataclasses.replace(p, stop=[stop]) for p in plain]
    runs = {overlap: asyncio.run(serve(overlap, stopping)) for overlap in (False, True)}
    (sync_outputs, sync_workers), (async_outputs, async_workers) = runs[False], runs[True]
    assert summary(async_outputs) == summary(sync_outputs)
    stopped = [o for o in async_outputs if o.outputs[0].finish_reason == "stop"]
    assert stopped and all(o.outputs[0].stop_reason == stop for o in stopped)
    for output in stopped:
        assert output.outputs[0].text == reference_text(reference, output, stop)

    def computed(workers: SlotWorkers) -> int:
        return sum(len(plan.sequences) for plan in workers.plans)

    # each stopped branch had one token computed after its last (dropped, never reported)
    assert computed(async_workers) == computed(sync_workers) + len(stopped)


def reference_text(reference: list[RequestOutput], output: RequestOutput, stop: str) -> str:
    full = next(r for r in reference if r.request_id == output.request_id).outputs[0].text
    return full[: full.find(stop)]


def test_an_abort_under_overlap_frees_its_blocks_and_leaves_the_others_exact() -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 8
    params[-1] = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    reference, _ = asyncio.run(serve(False, params))
    outputs, _ = asyncio.run(serve(True, params, abort_after=5))
    assert summary(outputs[:-1]) == summary(reference[:-1])
    aborted = outputs[-1].outputs[0]
    assert aborted.finish_reason == "abort"
    assert 5 <= len(aborted.token_ids) < 200
    assert aborted.token_ids == reference[-1].outputs[0].token_ids[: len(aborted.token_ids)]


def test_constrained_and_speculative_outputs_are_identical_with_overlap(
    tiny_model_dir: pathlib.Path,
) -> None:
    """JSON-schema constrained seeded sampling with n-gram drafts, and greedy decoding whose
    stop strings fall inside accepted drafts: the grammar advances before the next step's
    bitmask and a late stop drops the drafts after it, so nothing differs with overlap."""
    json_prompts = STRUCTURED_PROMPTS * 2
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    for overlap in (False, True):
        sections = {**PRESSURE["speculation"], "scheduler": {"async_scheduling": overlap}}
        with LLM(config=tiny_config(tiny_model_dir, **sections)) as llm:
            constrained = llm.generate(
                json_prompts, [_constrained(seed=s) for s in range(len(json_prompts))]
            )
            plain = llm.generate(REPEATING, greedy)
            stops = [dataclasses.replace(greedy, stop=[o.outputs[0].text[12:15]]) for o in plain]
            stopped = llm.generate(REPEATING, stops)
            speculation = llm.metrics().speculation
            assert speculation is not None and speculation.num_accepted_tokens > 0
            assert_all_free(llm)
        assert all(_valid_json(o.outputs[0].text) for o in constrained)
        assert all(o.outputs[0].finish_reason == "stop" for o in stopped)
        results[overlap] = summary(constrained + plain + stopped)
    assert results[True] == results[False]
