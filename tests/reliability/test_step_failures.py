"""A failed step ends only what it can be blamed on.

The workers are the tiny model's in-process rank behind `FaultyWorkers`, which refuses a plan as
a rank does (a `PlanRejected` naming the poisoned prompt's sequence, or a bare ValueError) or
fails as a dead rank does (RuntimeError). Invariants checked: a refused plan ends the blamed
request with RequestFailed while every other request finishes with its exact greedy tokens, the
loop stays alive and every block comes back; a worker failure marks the engine dead and ends
every stream with EngineDead.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine_core import EngineCore
from cluster.engine.errors import EngineDead, RequestFailed
from cluster.engine.llm import LLM
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from tests.engine.streams import engine_outputs
from tests.engine.tiny_engine import tiny_config
from workers import WorkerGroup
from workers.plan import PlanRejected, StepOutput, StepPlan

POISON = 7
"""A prompt starting with this token id is refused by `FaultyWorkers` when it is prefilled."""
GOOD_PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37, 38, 39]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
"""The first good request's: it is still decoding when the poisoned one arrives."""


def params_of(index: int) -> SamplingParams:
    return LONG if index == 0 else PARAMS


class FaultyWorkers:
    """A real worker group whose `execute_async` fails the way `mode` says on a plan that
    prefills a poisoned prompt: "blame" (PlanRejected naming it), "refuse" (a bare ValueError)
    or "die" (RuntimeError, as a dead rank)."""

    def __init__(self, inner: WorkerGroup, mode: str) -> None:
        self.inner = inner
        self.mode = mode
        self.failures = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def check(self, plan: StepPlan) -> None:
        poisoned = [
            w.seq_id for w in plan.sequences if w.start_pos == 0 and w.token_ids[0] == POISON
        ]
        if poisoned:
            self.failures += 1
            if self.mode == "blame":
                raise PlanRejected(f"step {plan.step_id}: poisoned", tuple(poisoned))
            if self.mode == "refuse":
                raise ValueError(f"step {plan.step_id}: refused")
            raise RuntimeError("rank 1 died")

    def execute(self, plan: StepPlan) -> StepOutput:
        self.check(plan)
        return self.inner.execute(plan)

    async def execute_async(self, plan: StepPlan) -> StepOutput:
        self.check(plan)
        return await self.inner.execute_async(plan)


async def collect(stream: AsyncIterator[RequestOutput]) -> list[int] | BaseException:
    try:
        outputs = [o async for o in stream]
    except Exception as error:  # the test inspects it
        return error
    return outputs[-1].outputs[0].token_ids


async def run_scenario(engine: AsyncEngine) -> list[list[int] | BaseException]:
    build = engine.request_builder.build
    good = [build({"prompt_token_ids": ids}, params_of(i)) for i, ids in enumerate(GOOD_PROMPTS)]
    bad = build({"prompt_token_ids": [POISON, 1, 2, 3]}, PARAMS)
    first = asyncio.create_task(collect(engine_outputs(engine, good[0])))
    while engine.metrics().num_generated_tokens < 2:  # the first request is decoding
        await asyncio.sleep(0.005)
    others = asyncio.gather(*(collect(engine_outputs(engine, r)) for r in [bad, *good[1:]]))
    rest = await others
    return [await first, *rest]


@pytest.fixture(scope="module")
def expected(tiny_model_dir: pathlib.Path) -> list[list[int]]:
    """Each good prompt's greedy tokens from a healthy engine, one request at a time: what every
    scenario's surviving requests must produce (computed once; no scenario changes them)."""

    async def scenario() -> list[list[int]]:
        engine = await AsyncEngine.create(tiny_config(tiny_model_dir))
        build = engine.request_builder.build
        results = [
            await collect(engine_outputs(engine, build({"prompt_token_ids": ids}, params_of(i))))
            for i, ids in enumerate(GOOD_PROMPTS)
        ]
        await engine.shutdown()
        return results  # type: ignore[return-value]

    return asyncio.run(scenario())


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async_scheduling"])
@pytest.mark.parametrize("mode", ["blame", "refuse"])
def test_a_refused_plan_fails_only_its_requests(
    tiny_model_dir: pathlib.Path, expected: list[list[int]], mode: str, overlap: bool
) -> None:

    async def scenario() -> None:
        config = tiny_config(tiny_model_dir, scheduler={"async_scheduling": overlap})
        workers = FaultyWorkers(WorkerGroup(config.to_worker_config()), mode)
        engine = AsyncEngine(config, workers)  # type: ignore[arg-type]
        first, bad, *rest = await run_scenario(engine)
        assert workers.failures == 1
        assert isinstance(bad, RequestFailed) and "step" in str(bad)
        if mode == "blame":  # only the poisoned request failed; the others were recomputed
            assert [first, *rest] == expected
        else:  # the step's requests failed with it; the ones after it are untouched
            assert all(
                r == e or isinstance(r, RequestFailed)
                for r, e in zip([first, *rest], expected, strict=True)
            )
        assert engine.health().alive
        # the engine goes on serving
        again = await collect(
            engine_outputs(
                engine, engine.request_builder.build({"prompt_token_ids": GOOD_PROMPTS[1]}, PARAMS)
            )
        )
        assert again == expected[1]
        metrics = engine.metrics()
        assert metrics.pressure.device.used == 0 and metrics.num_failed_requests >= 1
        await engine.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async_scheduling"])
def test_a_worker_failure_marks_the_engine_dead(
    tiny_model_dir: pathlib.Path, overlap: bool
) -> None:
    async def scenario() -> None:
        config = tiny_config(tiny_model_dir, scheduler={"async_scheduling": overlap})
        engine = AsyncEngine(config, FaultyWorkers(WorkerGroup(config.to_worker_config()), "die"))  # type: ignore[arg-type]
        results = await run_scenario(engine)
        assert all(isinstance(r, EngineDead) for r in results), results
        assert not engine.health().alive
        with pytest.raises(EngineDead):
            await anext(engine_outputs(engine, engine.request_builder.build("Hello", PARAMS)))
        await engine.shutdown()

    asyncio.run(scenario())


def test_the_offline_path_isolates_a_refused_plan_alike(
    tiny_model_dir: pathlib.Path, expected: list[list[int]]
) -> None:
    """`EngineCore.step` (what `LLM` runs) judges a refusal as the async loop does: the blamed
    request fails alone, the others of its step are recomputed to their exact greedy tokens."""
    config = tiny_config(tiny_model_dir)
    workers = FaultyWorkers(WorkerGroup(config.to_worker_config()), "blame")
    core = EngineCore(config, workers)  # type: ignore[arg-type]
    build = core.request_builder.build
    good = [
        core.add_request(build({"prompt_token_ids": ids}, params_of(i)))
        for i, ids in enumerate(GOOD_PROMPTS)
    ]
    bad = core.add_request(build({"prompt_token_ids": [POISON, 1, 2, 3]}, PARAMS))
    finals: dict[str, RequestOutput] = {}
    while core.has_work():
        for output in core.step():
            if output.finished or output.error is not None:
                finals[output.request_id] = output
    assert workers.failures == 1 and bad.failed
    assert "poisoned" in (finals[bad.request_id].error or "")
    assert [finals[r.request_id].outputs[0].token_ids for r in good] == expected
    assert core.metrics().pressure.device.used == 0
    core.shutdown()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async_scheduling"])
def test_llm_raises_request_failed_and_serves_the_next_call(
    tiny_model_dir: pathlib.Path, expected: list[list[int]], overlap: bool
) -> None:
    config = tiny_config(tiny_model_dir, scheduler={"async_scheduling": overlap})
    workers = FaultyWorkers(WorkerGroup(config.to_worker_config()), "refuse")
    with LLM(config=config) as llm:
        llm.engine.workers = workers  # type: ignore[assignment]
        prompts = [{"prompt_token_ids": [POISON, 1, 2, 3]}, {"prompt_token_ids": GOOD_PROMPTS[1]}]
        with pytest.raises(RequestFailed, match="refused"):
            llm.generate(prompts, PARAMS)
        again = llm.generate({"prompt_token_ids": GOOD_PROMPTS[1]}, PARAMS)
        assert again[0].outputs[0].token_ids == expected[1]
        assert llm.metrics().pressure.device.used == 0
