"""Workers forget every request that ended: a plan that only releases sequences reaches them,
and the last releases are sent once the engine goes idle."""

from __future__ import annotations

import asyncio
import pathlib

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.config import EngineConfig
from cluster.engine.engine_core import EngineCore
from cluster.engine.llm import LLM
from cluster.engine.scheduler_step import SchedulerStep
from tests.engine.streams import engine_outputs
from tests.engine.tiny_engine import GREEDY, PROMPTS, assert_all_free, tiny_config
from workers.plan import StepPlan

RECOMPUTE = {
    "cache": {"num_device_blocks": 16, "block_size": 4},
    "scheduler": {"preemption_mode": "recompute"},
}


def registry_of(engine: EngineCore) -> dict[int, object]:
    local = engine.workers._local
    assert local is not None, "the tests run the in-process rank"
    return dict(local.registry.states)


def test_a_release_only_plan_is_not_empty() -> None:
    step = SchedulerStep(plan=StepPlan(step_id=1, released=[7]), works=[])
    assert not step.is_empty and not step.runs_anything
    assert SchedulerStep(plan=StepPlan(step_id=2), works=[]).is_empty


def test_a_release_only_step_reaches_the_workers(tiny_model_dir: pathlib.Path) -> None:
    """A request the workers know ends while nothing else runs: the next step's plan carries
    only its release, and the workers must get it (it was dropped as an empty step)."""
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        core = llm.engine
        request = core.add_request(core.request_builder.build(PROMPTS[1], GREEDY))
        core.step()
        assert registry_of(core) != {}
        core.abort(request.request_id)
        core.step()  # schedules a plan with nothing but the release
        assert registry_of(core) == {}


def test_registry_is_empty_after_recompute_preempted_requests_end(
    tiny_model_dir: pathlib.Path,
) -> None:
    config: EngineConfig = tiny_config(tiny_model_dir, **RECOMPUTE)
    with LLM(config=config) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        assert all(o.finished for o in outputs)
        assert llm.metrics().preemptions_recompute >= 1, "the scenario must preempt"
        assert_all_free(llm)
        assert registry_of(llm.engine) == {}


def test_async_engine_releases_everything_once_idle(tiny_model_dir: pathlib.Path) -> None:
    async def scenario() -> None:
        engine = await AsyncEngine.create(tiny_config(tiny_model_dir, **RECOMPUTE))
        build = engine.request_builder.build

        async def run(prompt: str) -> None:
            async for _ in engine_outputs(engine, build(prompt, GREEDY)):
                pass

        await asyncio.gather(*(run(p) for p in PROMPTS))
        assert engine.metrics().preemptions_recompute >= 1
        for _ in range(200):  # the loop flushes the last releases right after the last step
            if not registry_of(engine.core):
                break
            await asyncio.sleep(0.01)
        assert registry_of(engine.core) == {}
        assert engine.metrics().pressure.device.used == 0
        await engine.shutdown()

    asyncio.run(scenario())
