"""Aborted requests are counted, in the engine's metrics and in `/metrics` as
`pagedserve_requests_total{outcome="aborted"}`."""

from __future__ import annotations

import asyncio
import pathlib

from prometheus_client.parser import text_string_to_metric_families

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.prometheus import render_prometheus
from tests.engine.streams import engine_outputs
from tests.engine.tiny_engine import tiny_config

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def requests_total(text: bytes) -> dict[str, float]:
    totals = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name == "pagedserve_requests_total":
                totals[sample.labels["outcome"]] = sample.value
    return totals


def test_closed_streams_and_aborts_are_counted(tiny_model_dir: pathlib.Path) -> None:
    async def scenario() -> None:
        engine = await AsyncEngine.create(tiny_config(tiny_model_dir))
        build = engine.request_builder.build
        async for _ in engine_outputs(engine, build("Hello", SHORT)):
            pass
        closed = engine_outputs(engine, build("Hello", LONG))
        await anext(closed)
        await closed.aclose()  # the client went away
        by_id = engine_outputs(engine, build("Hi", LONG, request_id="by-id"))
        await anext(by_id)
        await engine.abort("by-id")
        assert [o async for o in by_id][-1].outputs[0].finish_reason == "abort"
        await engine.abort("unknown")  # nothing to count
        metrics = engine.metrics()
        assert (metrics.num_finished_requests, metrics.num_aborted_requests) == (1, 2)
        assert metrics.pressure.device.used == 0
        totals = requests_total(render_prometheus({"r0": metrics}))
        assert totals["aborted"] == 2 and totals["finished"] == 1 and totals["failed"] == 0
        await engine.shutdown()

    asyncio.run(scenario())
