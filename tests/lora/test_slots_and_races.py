"""Slots, the CPU LRU and adapters loaded or removed while requests run (tiny Llama).

Oracles: each request run alone on the same engine (greedy tokens must be equal), and the plans
the workers receive (never more distinct adapter slots than `max_loras` in one step).
"""

from __future__ import annotations

import asyncio
import pathlib
import shutil
from typing import Any

import pytest

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.errors import AdapterNotFound, RequestFailed
from cluster.engine.llm import LLM
from cluster.engine.lora_request import LoRARequest
from cluster.engine.sampling_params import SamplingParams
from tests.engine.streams import engine_outputs
from tests.engine.tiny_engine import tiny_config
from workers.plan import StepPlan

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Paged attention stores", "1 2 3 4", "Hello there"]


def _config(model_dir: pathlib.Path, **lora: Any) -> Any:
    return tiny_config(
        model_dir, lora={"enable_lora": True, "max_lora_rank": 16, "max_loras": 1, **lora}
    )


def _record_plans(llm: LLM) -> list[StepPlan]:
    plans: list[StepPlan] = []
    execute = llm.engine.workers.execute

    def recording(plan: StepPlan) -> Any:
        plans.append(plan)
        return execute(plan)

    llm.engine.workers.execute = recording  # type: ignore[method-assign]
    return plans


def test_one_slot_serves_three_adapters_in_arrival_order(
    tiny_model_dir: pathlib.Path, tiny_adapters: dict[str, pathlib.Path]
) -> None:
    """max_loras=1: requests of other adapters wait for the slot (none fails); base-model
    requests pass a waiting one, later adapter requests do not; every output equals its run
    alone."""
    loras = {
        name: LoRARequest(name, i + 1, str(path))
        for i, (name, path) in enumerate(tiny_adapters.items())
    }
    order = [("all8", 0), ("qv16", 1), (None, 2), ("all8", 3), ("rs4", 0), (None, 1)]
    with LLM(config=_config(tiny_model_dir, max_cpu_loras=3)) as llm:
        alone = [
            llm.generate(PROMPTS[p], GREEDY, lora_request=loras.get(n or ""))[0] for n, p in order
        ]
        plans = _record_plans(llm)
        first_seq = next(llm.engine._seq_ids)  # the batch's requests get the next ids
        mixed = llm.generate(
            [PROMPTS[p] for _, p in order],
            GREEDY,
            lora_request=[loras.get(n or "") for n, _ in order],
        )
        metrics = llm.metrics()
    assert [m.outputs[0].token_ids for m in mixed] == [a.outputs[0].token_ids for a in alone]
    started: dict[int, int] = {}
    for step, plan in enumerate(plans):
        assert len({w.lora_slot for w in plan.sequences} - {-1}) <= 1
        for work in plan.sequences:
            started.setdefault(work.seq_id - first_seq - 1, step)
    # all8 and both base requests start at once; qv16 waits for the slot, then all8's second
    # request (behind it) and rs4 after that
    assert started[0] == started[2] == started[5] == 0
    assert 0 < started[1] < started[3] <= started[4] or 0 < started[1] < started[4] < started[3]
    assert started[3] > started[1] and started[4] > started[1]
    assert metrics.adapter_loads_total >= 3 + 3  # the alone runs, then the batch
    assert metrics.adapter_evictions_total >= 4


def test_remove_while_running_and_add_while_running(
    tiny_model_dir: pathlib.Path, tiny_adapters: dict[str, pathlib.Path]
) -> None:
    a = LoRARequest("all8", 1, str(tiny_adapters["all8"]))
    b = LoRARequest("qv16", 2, str(tiny_adapters["qv16"]))
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def collect(engine: AsyncEngine, prompt: str, adapter: str | None) -> list[int]:
        request = engine.request_builder.build(prompt, long, adapter=adapter)
        final = None
        async for output in engine_outputs(engine, request):
            final = output
        assert final is not None
        return final.outputs[0].token_ids

    async def run() -> None:
        config = _config(tiny_model_dir, max_loras=2)
        engine = await AsyncEngine.create(config)
        try:
            await engine.add_lora(a)
            expected_a = [await collect(engine, p, "all8") for p in PROMPTS[:3]]
            tasks = [asyncio.create_task(collect(engine, p, "all8")) for p in PROMPTS[:3]]
            while engine.metrics().adapter_generation_tokens_total.get("all8", 0) < 36 + 2:
                await asyncio.sleep(0.005)  # the three are decoding
            await engine.remove_lora("all8")
            with pytest.raises(AdapterNotFound):
                await collect(engine, PROMPTS[0], "all8")
            await engine.add_lora(b)  # loaded while all8's requests still decode
            with_b = await collect(engine, PROMPTS[3], "qv16")
            assert [await t for t in tasks] == expected_a
            assert engine.core.lora is not None
            assert set(engine.core.lora.weights) == {engine.core.lora.digest_of["qv16"]}
            assert engine.adapter_digests() == {"qv16": engine.core.lora.digest_of["qv16"]}
            assert [lora.lora_name for lora in await engine.list_loras()] == ["qv16"]
            assert with_b == await collect(engine, PROMPTS[3], "qv16")
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_cpu_lru_reloads_from_disk_and_refuses_changed_files(
    tiny_model_dir: pathlib.Path, tiny_adapters: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    """max_cpu_loras=1: loading b drops a from CPU memory; a request for a reads it again (same
    output); once a's files change on disk, its request fails naming why and a concurrent base
    request is served."""
    path_a = tmp_path / "a"
    shutil.copytree(tiny_adapters["all8"], path_a)
    a = LoRARequest("a", 1, str(path_a))
    b = LoRARequest("b", 2, str(tiny_adapters["qv16"]))

    async def collect(engine: AsyncEngine, prompt: str, adapter: str | None) -> list[int]:
        request = engine.request_builder.build(prompt, GREEDY, adapter=adapter)
        final = None
        async for output in engine_outputs(engine, request):
            final = output
        assert final is not None
        return final.outputs[0].token_ids

    async def run() -> None:
        engine = await AsyncEngine.create(_config(tiny_model_dir, max_cpu_loras=1))
        try:
            await engine.add_lora(a)
            first = await collect(engine, PROMPTS[0], "a")
            await engine.add_lora(b)
            await collect(engine, PROMPTS[0], "b")  # a leaves its slot and CPU memory
            assert await collect(engine, PROMPTS[0], "a") == first  # read again from disk
            await collect(engine, PROMPTS[0], "b")
            for name in ("adapter_model.safetensors", "adapter_config.json"):
                shutil.copy(tiny_adapters["rs4"] / name, path_a / name)
            base = asyncio.create_task(collect(engine, PROMPTS[1], None))
            with pytest.raises(RequestFailed, match="changed on disk"):
                await collect(engine, PROMPTS[0], "a")
            assert len(await base) == GREEDY.max_tokens
            assert engine.health().alive
            assert engine.metrics().adapter_evictions_total >= 3
        finally:
            await engine.shutdown()

    asyncio.run(run())
