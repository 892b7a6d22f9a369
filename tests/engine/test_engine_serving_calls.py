"""The engine calls the serving layer uses, on the tiny Llama in process: `health()`,
the block-hash chain a request is routed by, and `generate(..., shared_prefix_tokens=...)`."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.errors import EngineDead
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from tests.engine.streams import block_hashes, cached_block_hashes, engine_outputs
from tests.engine.tiny_engine import tiny_config

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(10, 60))}  # 50 tokens: 6 full blocks of 8 hit-able
SALT = b"tenant-a"


async def final(engine: AsyncEngine, prompt: object, **kwargs: object) -> RequestOutput:
    request = engine.request_builder.build(prompt, ONE_TOKEN, **kwargs)  # type: ignore[arg-type]
    outputs = [o async for o in engine_outputs(engine, request)]
    return outputs[-1]


def test_health_reports_steps_and_a_dead_loop_even_when_idle(
    tiny_model_dir: pathlib.Path,
) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(tiny_config(tiny_model_dir))
        before = engine.health()
        assert before.alive and before.error is None
        assert before.last_step_finished_s is None and before.num_unfinished == 0
        await final(engine, PROMPT)
        after = engine.health()
        assert after.alive and after.num_unfinished == 0
        assert after.last_step_finished_s is not None

        async def broken(plan: object) -> object:
            raise RuntimeError("worker lost")

        engine.core.workers.execute_async = broken  # type: ignore[method-assign]
        with pytest.raises(EngineDead, match="worker lost"):
            await final(engine, {"prompt_token_ids": [5, 6, 7]})
        await asyncio.sleep(0.01)  # idle now: nothing else will touch the loop
        dead = engine.health()
        assert not dead.alive and dead.error is not None and "worker lost" in dead.error
        assert dead.last_step_finished_s == after.last_step_finished_s
        await engine.shutdown()
        assert not engine.health().alive

    asyncio.run(scenario())


def test_prompt_block_hashes_are_what_the_engine_then_caches(
    tiny_model_dir: pathlib.Path,
) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(tiny_config(tiny_model_dir))
        assert cached_block_hashes(engine) == []
        build = engine.request_builder.build
        mine = block_hashes(engine, build(PROMPT, ONE_TOKEN, tenant_salt=SALT))
        assert len(mine) == (50 - 1) // 8
        shared = block_hashes(
            engine, build(PROMPT, ONE_TOKEN, tenant_salt=SALT, shared_prefix_tokens=20)
        )
        others = block_hashes(
            engine, build(PROMPT, ONE_TOKEN, tenant_salt=b"b", shared_prefix_tokens=20)
        )
        assert shared[:2] == others[:2] and not set(shared[2:]) & set(others[2:])
        assert not set(mine) & set(shared)  # the chain differs from the first block on

        await final(engine, PROMPT, tenant_salt=SALT, shared_prefix_tokens=20)
        cached = cached_block_hashes(engine)
        assert set(shared) <= set(cached) and not set(mine) & set(cached)
        # Another tenant with the same declared prefix finds exactly its two whole blocks.
        other = await final(engine, PROMPT, tenant_salt=b"b", shared_prefix_tokens=20)
        assert other.num_cached_tokens == 16
        assert set(others) <= set(cached_block_hashes(engine))
        await engine.shutdown()

    asyncio.run(scenario())
