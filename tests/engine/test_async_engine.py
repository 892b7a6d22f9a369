"""The asyncio engine on the tiny Llama: in process, and over TP=2 Ray worker actors."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from tests.engine.streams import block_hashes, cached_block_hashes, engine_outputs
from tests.engine.tiny_engine import GREEDY, PROMPTS, greedy_ids, tiny_config

# The Ray tests here run Ray core actors only (no Serve): beside the Serve tests under xdist.
pytestmark = pytest.mark.plain_ray


async def collect(stream: object) -> list[RequestOutput]:
    return [output async for output in stream]  # type: ignore[attr-defined]


def test_streams_deltas_and_abort_frees_everything(tiny_model_dir: pathlib.Path) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(tiny_config(tiny_model_dir, cache={"num_device_blocks": 40}))
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        keep = asyncio.create_task(
            collect(engine_outputs(engine, engine.request_builder.build(PROMPTS[0], GREEDY)))
        )
        stream = engine_outputs(
            engine, engine.request_builder.build(PROMPTS[3], long, request_id="to-abort")
        )
        first = await anext(stream)
        assert first.outputs[0].token_ids and not first.finished
        await engine.abort("to-abort")
        rest = [o async for o in stream]
        assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        outputs = await keep
        final = outputs[-1]
        assert final.finished and len(final.outputs[0].token_ids) == GREEDY.max_tokens
        assert "".join(o.outputs[0].delta_text for o in outputs) == final.outputs[0].text
        joined = [t for o in outputs for t in o.outputs[0].delta_token_ids]
        assert joined == final.outputs[0].token_ids
        assert final.metrics.ttft is not None and final.metrics.inter_token_times
        metrics = engine.metrics()
        assert metrics.pressure.device.used == 0 and metrics.num_running == 0
        assert metrics.ttft_seconds.count == 2
        await engine.shutdown()

    asyncio.run(scenario())


def test_async_engine_with_tensor_parallel_two(
    tiny_model_dir: pathlib.Path, roomy_outputs: list[RequestOutput], ray_cluster: object
) -> None:
    expected = greedy_ids(roomy_outputs[:3])

    async def scenario() -> None:
        config = tiny_config(tiny_model_dir, parallel={"backend": "ray", "tensor_parallel_size": 2})
        engine = AsyncEngine(config)
        build = engine.request_builder.build
        results = await asyncio.gather(
            *(collect(engine_outputs(engine, build(p, GREEDY))) for p in PROMPTS[:3])
        )
        assert [r[-1].outputs[0].token_ids for r in results] == expected
        metrics = engine.metrics()
        assert metrics.pressure.device.used == 0 and metrics.num_finished_requests == 3
        health = engine.health()
        assert health.alive and health.num_unfinished == 0 and health.last_step_finished_s
        hashes = block_hashes(engine, build(PROMPTS[1], GREEDY))
        assert hashes and set(hashes) <= set(cached_block_hashes(engine))
        await engine.shutdown()

    asyncio.run(scenario())
