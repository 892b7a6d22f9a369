"""TP=2 (two Ray actors joined by gloo) equals TP=1 with adapters on the tiny Llama: each rank
loads only its slice (B's rows of q/k/v/gate/up, A's columns of o/down) and the row-parallel
intermediate is all-reduced. Logits within 1e-4 (the TP tests' tolerance), tokens equal."""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.engine.streams import engine_outputs
from tests.workers.paged_runner import greedy_generate
from workers import StepPlan, WorkerConfig, WorkerGroup
from workers.plan import LoRASlotLoad

# The Ray tests here run Ray core actors only (no Serve): beside the Serve tests under xdist.
pytestmark = pytest.mark.plain_ray

LOGITS_ATOL = 1e-4
PROMPTS = [[1, 5, 77, 300, 12, 9, 4000], [1, 42, 42, 7, 19], [1, 8, 1000, 3]]


def _run(group: WorkerGroup, adapters: list[pathlib.Path]) -> tuple[list[list[int]], list]:
    loads = []
    for slot, path in enumerate(adapters):
        summary = group.add_lora(str(path))
        loads.append(LoRASlotLoad(slot, summary.digest, str(path)))
    group.execute(StepPlan(0, lora_loads=loads))
    run = greedy_generate(group, PROMPTS, 6, seed=2, lora_slots=[0, 1, -1], first_seq_id=10)
    return run.tokens, run.logits


def test_tp2_equals_tp1_with_adapters(
    ray_cluster: None,
    tiny_model_dir: pathlib.Path,
    tiny_adapters: dict[str, pathlib.Path],
    tmp_path: pathlib.Path,
) -> None:
    adapters = [tiny_adapters["all8"], tiny_adapters["rs4"]]
    settings = dict(
        model=str(tiny_model_dir),
        dtype="float32",
        block_size=4,
        num_device_blocks=32,
        weights_cache_dir=str(tmp_path),
        max_loras=2,
        max_lora_rank=16,
    )
    single = WorkerGroup(WorkerConfig(backend="local", **settings))  # type: ignore[arg-type]
    try:
        tokens_1, logits_1 = _run(single, adapters)
    finally:
        single.shutdown()
    double = WorkerGroup(
        WorkerConfig(backend="ray", tensor_parallel_size=2, **settings)  # type: ignore[arg-type]
    )
    try:
        tokens_2, logits_2 = _run(double, adapters)
        with pytest.raises(ValueError, match=r"has no adapter_config\.json"):
            double.add_lora(str(tmp_path))  # refused on every rank, named across Ray
    finally:
        double.shutdown()
    assert tokens_2 == tokens_1
    for ours, theirs in zip(logits_2, logits_1, strict=True):
        torch.testing.assert_close(ours, theirs, atol=LOGITS_ATOL, rtol=0)


def test_async_engine_over_ray_serves_adapters(
    ray_cluster: None, tiny_model_dir: pathlib.Path, tiny_adapters: dict[str, pathlib.Path]
) -> None:
    """The engine on two Ray ranks: `add_lora` reaches both, and a batch mixing two adapters
    and the base model gives the tokens the in-process engine gives."""
    import asyncio

    from cluster.engine.async_engine import AsyncEngine
    from cluster.engine.llm import LLM
    from cluster.engine.lora_request import LoRARequest
    from cluster.engine.sampling_params import SamplingParams
    from tests.engine.tiny_engine import tiny_config

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    loras = [
        LoRARequest("all8", 1, str(tiny_adapters["all8"])),
        LoRARequest("rs4", 2, str(tiny_adapters["rs4"])),
        None,
    ]
    prompts = ["The quick brown fox", "Paged attention", "1 2 3"]
    lora = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    with LLM(config=tiny_config(tiny_model_dir, lora=lora)) as llm:
        expected = [
            o.outputs[0].token_ids for o in llm.generate(prompts, greedy, lora_request=loras)
        ]

    async def scenario() -> list[list[int]]:
        config = tiny_config(
            tiny_model_dir, lora=lora, parallel={"backend": "ray", "tensor_parallel_size": 2}
        )
        engine = await AsyncEngine.create(config)
        try:
            for adapter in loras[:2]:
                assert adapter is not None
                await engine.add_lora(adapter)

            async def one(prompt: str, adapter: LoRARequest | None) -> list[int]:
                name = None if adapter is None else adapter.lora_name
                final = None
                async for output in engine_outputs(
                    engine, engine.request_builder.build(prompt, greedy, adapter=name)
                ):
                    final = output
                assert final is not None
                return final.outputs[0].token_ids

            calls = [one(p, a) for p, a in zip(prompts, loras, strict=True)]
            return list(await asyncio.gather(*calls))
        finally:
            await engine.shutdown()

    assert asyncio.run(scenario()) == expected
