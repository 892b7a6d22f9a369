"""Async scheduling plans a step ahead: while step N runs, step N+1 is planned with a placeholder
for each decode's token, filled on the worker side from N's output; what N's tokens end is
dropped. Nothing a client sees changes.

Oracles: the same engine with the knob off (token for token, text, finish and stop reasons,
log-probabilities), `reference_tokens` (the slot simulator's tokens with no paging at all) and
a block manager whose every block is free once everything ended. That plans ahead happened,
and what they cost, is read from the plans the workers executed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
from typing import Any

import pytest

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.errors import RequestFailed
from cluster.engine.llm import LLM
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from tests.engine.slot_workers import SlotWorkers, reference_tokens
from tests.engine.streams import engine_outputs
from tests.engine.test_async_scheduling import serve, slot_config, slot_prompts, summary
from tests.engine.tiny_engine import GREEDY, PROMPTS, assert_all_free, tiny_config
from workers.plan import PLACEHOLDER_TOKEN_ID, PlanRejected, StepOutput, StepPlan

# The Ray tests here run Ray core actors only (no Serve): beside the Serve tests under xdist.
pytestmark = pytest.mark.plain_ray


class PlanLog:
    """A worker group that keeps every plan it is given (filled in place by the group)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.plans: list[StepPlan] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        return self.inner.execute(plan)

    async def execute_async(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        return await self.inner.execute_async(plan)


def ahead(plans: list[StepPlan]) -> list[StepPlan]:
    return [plan for plan in plans if plan.placeholders_of is not None]


def samples_computed(plans: list[StepPlan]) -> int:
    return sum(work.num_samples for plan in plans for work in plan.sequences)


def assert_filled(plans: list[StepPlan]) -> None:
    for plan in ahead(plans):
        assert plan.placeholders_of == plan.step_id - 1
        for work in plan.sequences:
            assert work.placeholder and work.token_ids != [PLACEHOLDER_TOKEN_ID]


def assert_reference(outputs: list[RequestOutput], params: list[SamplingParams]) -> None:
    for output, p, prompt in zip(outputs, params, slot_prompts(), strict=True):
        settings = p.to_settings(p.seed if p.seed is not None else 0)
        for branch in output.outputs:
            expected = reference_tokens(
                prompt,
                settings,
                branch_index=branch.index,
                max_tokens=p.max_tokens or 0,
                ignore_eos=p.ignore_eos,
            )
            assert branch.token_ids == expected


def both_ways(params: list[SamplingParams]) -> list[tuple[list[RequestOutput], SlotWorkers]]:
    """`serve` without, then with async scheduling."""
    return [asyncio.run(serve(overlap, params)) for overlap in (False, True)]


def test_max_tokens_is_foreseen_so_planning_ahead_computes_nothing_in_vain() -> None:
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=5 + 4 * i)
        for i in range(8)
    ]
    params = [dataclasses.replace(p, ignore_eos=True) for p in params]
    (sync, sync_workers), (late, late_workers) = both_ways(params)
    assert summary(late) == summary(sync)
    assert_reference(late, params)
    assert ahead(sync_workers.plans) == []
    assert len(ahead(late_workers.plans)) > 20
    assert_filled(late_workers.plans)
    assert samples_computed(late_workers.plans) == samples_computed(sync_workers.plans)


def test_a_token_after_eos_is_computed_and_dropped() -> None:
    """EOS is only known from the token itself: the branch's next token, planned ahead, is
    computed and never reported."""
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=60) for i in range(8)
    ]
    (sync, sync_workers), (late, late_workers) = both_ways(params)
    assert summary(late) == summary(sync)
    assert_reference(late, params)
    assert_filled(late_workers.plans)
    eos_ended = sum(1 for o in late for b in o.outputs if b.finish_reason == "stop")
    assert eos_ended >= 3
    wasted = samples_computed(late_workers.plans) - samples_computed(sync_workers.plans)
    assert 1 <= wasted <= eos_ended


def test_an_abort_while_planned_ahead_leaves_the_others_exact() -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 8
    params[-1] = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    reference, _ = asyncio.run(serve(False, params))
    for abort_after in (5, 31, 60):  # while the others decode, as they end, alone
        outputs, workers = asyncio.run(serve(True, params, abort_after=abort_after))
        assert summary(outputs[:-1]) == summary(reference[:-1])
        aborted = outputs[-1].outputs[0]
        assert aborted.finish_reason == "abort"
        assert abort_after <= len(aborted.token_ids) < 200
        assert aborted.token_ids == reference[-1].outputs[0].token_ids[: len(aborted.token_ids)]
        assert ahead(workers.plans)
        assert_filled(workers.plans)


class RefusingSlotWorkers(SlotWorkers):
    """Refuses the third plan planned ahead, blaming its first sequence (a decode step whose
    successor is planned ahead of it by then)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.refused: StepPlan | None = None

    def execute(self, plan: StepPlan) -> StepOutput:
        if len(ahead(self.plans)) == 2 and plan.placeholders_of is not None:
            self.refused = plan
            self.plans.append(plan)
            self.placeholders.record(None)
            raise PlanRejected("refused", (plan.sequences[0].seq_id,))
        return super().execute(plan)


def test_a_refused_step_with_a_step_planned_ahead_of_it_fails_only_its_blamed_request() -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 8

    async def scenario() -> tuple[list[RequestOutput | BaseException], RefusingSlotWorkers]:
        workers = RefusingSlotWorkers(
            num_device_blocks=64, num_cpu_blocks=0, block_size=4, max_model_len=256
        )
        engine = AsyncEngine(slot_config(async_scheduling=True), workers)  # type: ignore[arg-type]
        build = engine.request_builder.build

        async def run(index: int) -> RequestOutput | BaseException:
            request = build({"prompt_token_ids": slot_prompts()[index]}, params[index])
            try:
                return [o async for o in engine_outputs(engine, request)][-1]
            except RequestFailed as error:
                return error

        results = await asyncio.gather(*(run(i) for i in range(8)))
        bm = engine.core.block_manager
        assert bm.num_free_device_blocks() == bm.num_device_blocks
        await engine.shutdown()
        return list(results), workers

    results, workers = asyncio.run(scenario())
    reference, _ = asyncio.run(serve(False, params))
    assert workers.refused is not None
    after = next(p for p in workers.plans if p.step_id == workers.refused.step_id + 1)
    assert after.placeholders_of == workers.refused.step_id  # planned ahead of the refused one
    assert not any(work.placeholder for work in after.sequences)  # its placeholders dropped
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert len(failed) == 1
    for index, result in enumerate(results):
        if index not in failed:
            assert isinstance(result, RequestOutput)
            assert summary([result]) == summary([reference[index]])


def tiny_params() -> list[SamplingParams]:
    """One branch each (so steps are planned ahead): greedy, a stop string and a stop token id
    from the greedy answers, seeded sampling with logprobs, uneven `max_tokens`."""
    return [
        GREEDY,
        dataclasses.replace(GREEDY, stop=["e"]),
        dataclasses.replace(GREEDY, max_tokens=24, stop_token_ids=[]),
        SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=2),
        dataclasses.replace(GREEDY, max_tokens=3),
        SamplingParams(temperature=0.8, seed=11, max_tokens=20, stop=["a"]),
    ]


def with_stop_id(params: list[SamplingParams], roomy: list[RequestOutput]) -> list[SamplingParams]:
    stop_id = roomy[2].outputs[0].token_ids[6]
    params[2] = dataclasses.replace(params[2], stop_token_ids=[stop_id])
    return params


TIGHT = {"num_device_blocks": 14, "block_size": 4}
MEMORY: dict[str, dict[str, dict[str, Any]]] = {
    "roomy": {},
    **{
        layout: {
            "cache": {"kv_layout": layout, "enable_prefix_caching": False, "num_cpu_blocks": 0}
        }
        for layout in ("contiguous", "virtual")
    },
    **{
        mode: {"cache": TIGHT, "scheduler": {"preemption_mode": mode, "max_num_seqs": 3}}
        for mode in ("recompute", "swap")
    },
}
"""A roomy pool (paged, or a range layout), and pools of 14 blocks of 4 for three sequences at a
time (the others wait, so steps are planned ahead with requests waiting) that preempt by
recompute or by swap."""


@pytest.mark.parametrize("memory", sorted(MEMORY))
def test_the_tiny_model_decodes_the_same_planned_ahead(
    tiny_model_dir: pathlib.Path, roomy_outputs: list[RequestOutput], memory: str
) -> None:
    """The real worker group (its rank thread fills the placeholders), offline."""
    params = with_stop_id(tiny_params(), roomy_outputs)
    results = {}
    for overlap in (False, True):
        sections = {k: dict(v) for k, v in MEMORY[memory].items()}
        sections.setdefault("scheduler", {})["async_scheduling"] = overlap
        with LLM(config=tiny_config(tiny_model_dir, **sections)) as llm:
            log = PlanLog(llm.engine.workers)
            llm.engine.workers = log  # type: ignore[assignment]
            results[overlap] = summary(llm.generate(PROMPTS, params))
            metrics = llm.metrics()
            assert_all_free(llm)
        preempting = memory in ("recompute", "swap")
        assert preempting == (metrics.preemptions_recompute + metrics.preemptions_swap > 0)
        assert bool(ahead(log.plans)) == overlap
        assert_filled(log.plans)
    if not preempting:
        assert results[True] == results[False]
    else:  # preempting changes nothing either, but KV recomputed in other chunks than before
        for other in (results[False], results_roomy(tiny_model_dir, params)):
            assert_same_up_to_float_noise(results[True], other)
    finishes = {branch[2] for output in results[True] for branch in output}
    assert finishes == {"stop", "length"}


def assert_same_up_to_float_noise(ours: Any, theirs: Any) -> None:
    """Equal summaries, but log-probabilities within float32 noise: a request recomputed
    after a preemption has its KV computed in other chunks, which moves them in the last bits
    (and changes no token: the tokens are compared exactly)."""
    assert len(ours) == len(theirs)
    for our_request, their_request in zip(ours, theirs, strict=True):
        for our, their in zip(our_request, their_request, strict=True):
            assert our[:4] == their[:4]
            if our[4] is None or their[4] is None:
                assert our[4] is their[4]
                continue
            assert [t for t, _ in our[4]] == [t for t, _ in their[4]]
            assert [lp for _, lp in our[4]] == pytest.approx([lp for _, lp in their[4]], abs=1e-4)


def results_roomy(model_dir: pathlib.Path, params: list[SamplingParams]) -> Any:
    with LLM(config=tiny_config(model_dir)) as llm:
        return summary(llm.generate(PROMPTS, params))


def test_the_tiny_model_streams_the_same_planned_ahead(tiny_model_dir: pathlib.Path) -> None:
    """The real worker group's `execute_async`, from the async engine's tasks."""
    params = tiny_params()

    async def scenario(overlap: bool) -> tuple[list[RequestOutput], PlanLog]:
        config = tiny_config(tiny_model_dir, scheduler={"async_scheduling": overlap})
        engine = await AsyncEngine.create(config)
        log = PlanLog(engine.core.workers)
        engine.core.workers = log  # type: ignore[assignment]
        build = engine.request_builder.build
        requests = [build(prompt, p) for prompt, p in zip(PROMPTS, params, strict=True)]

        async def run(request: Any) -> RequestOutput:
            return [o async for o in engine_outputs(engine, request)][-1]

        outputs = await asyncio.gather(*(run(r) for r in requests))
        assert engine.core.block_manager.pressure().device.used == 0
        await engine.shutdown()
        return list(outputs), log

    (sync, _), (late, log) = (asyncio.run(scenario(o)) for o in (False, True))
    assert summary(late) == summary(sync)
    assert ahead(log.plans)
    assert_filled(log.plans)


def test_tensor_parallel_two_gets_its_placeholders_filled_before_the_ranks(
    tiny_model_dir: pathlib.Path, roomy_outputs: list[RequestOutput], ray_cluster: object
) -> None:
    """Ray: the group fills a plan's placeholders before it goes to both ranks (rank 1 never
    samples, so it could not fill them), offline and from the async engine: the greedy
    outputs equal TP = 1's without async scheduling."""
    expected = [o.outputs[0].token_ids for o in roomy_outputs]
    config = tiny_config(
        tiny_model_dir,
        parallel={"backend": "ray", "tensor_parallel_size": 2},
        scheduler={"async_scheduling": True},
    )
    with LLM(config=config) as llm:
        log = PlanLog(llm.engine.workers)
        llm.engine.workers = log  # type: ignore[assignment]
        outputs = llm.generate(PROMPTS, GREEDY)
        assert_all_free(llm)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert ahead(log.plans)
    assert_filled(log.plans)

    async def scenario() -> tuple[list[RequestOutput], PlanLog]:
        engine = AsyncEngine(config)
        async_log = PlanLog(engine.core.workers)
        engine.core.workers = async_log  # type: ignore[assignment]
        build = engine.request_builder.build

        async def run(prompt: str) -> RequestOutput:
            return [o async for o in engine_outputs(engine, build(prompt, GREEDY))][-1]

        streamed = await asyncio.gather(*(run(p) for p in PROMPTS))
        await engine.shutdown()
        return list(streamed), async_log

    streamed, async_log = asyncio.run(scenario())
    assert [o.outputs[0].token_ids for o in streamed] == expected
    assert ahead(async_log.plans)
    assert_filled(async_log.plans)
