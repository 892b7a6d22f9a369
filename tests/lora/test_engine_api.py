"""The engine's LoRA API on the tiny Llama: add/remove/list, requests naming adapters, greedy
tokens against HF transformers + PEFT, and a mixed batch equal to each request run alone."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.errors import AdapterNotFound, RequestRejected
from cluster.engine.llm import LLM
from cluster.engine.lora_request import LoRARequest
from cluster.engine.sampling_params import SamplingParams
from tests.engine.streams import engine_outputs
from tests.engine.tiny_engine import tiny_config
from tests.lora.conftest import peft_oracle
from tests.workers.paged_runner import hf_greedy

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Paged attention stores the KV cache", "1 2 3 4 5 6 7"]


def lora_config(model_dir: pathlib.Path, **lora: object) -> object:
    settings = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16, **lora}
    return tiny_config(model_dir, lora=settings)


async def _generate(engine: AsyncEngine, prompt: str, adapter: str | None) -> list[int]:
    request = engine.request_builder.build(prompt, GREEDY, adapter=adapter)
    final = None
    async for output in engine_outputs(engine, request):
        final = output
    assert final is not None and final.finished
    return final.outputs[0].token_ids


def test_async_engine_serves_an_adapter_like_peft(
    tiny_model_dir: pathlib.Path, tiny_adapters: dict[str, pathlib.Path]
) -> None:
    oracle = peft_oracle(tiny_model_dir, tiny_adapters["all8"])
    prompt_ids = None

    async def run() -> tuple[list[int], list[int], list[LoRARequest]]:
        nonlocal prompt_ids
        engine = await AsyncEngine.create(lora_config(tiny_model_dir))  # type: ignore[arg-type]
        try:
            lora = LoRARequest("all8", 1, str(tiny_adapters["all8"]))
            await engine.add_lora(lora)
            await engine.add_lora(lora)  # the same name and path again: a no-op
            prompt_ids = engine.request_builder.build(PROMPTS[0], GREEDY).token_ids
            with_adapter = await _generate(engine, PROMPTS[0], "all8")
            base = await _generate(engine, PROMPTS[0], None)
            listed = await engine.list_loras()
            await engine.remove_lora("all8")
            with pytest.raises(AdapterNotFound, match="all8"):
                await _generate(engine, PROMPTS[0], "all8")
            assert await engine.list_loras() == []
            metrics = engine.metrics()
            assert metrics.adapter_requests_total == {"all8": 1}
            assert metrics.adapter_generation_tokens_total == {"all8": NEW_TOKENS}
            assert metrics.adapter_loads_total == 1
            return with_adapter, base, listed
        finally:
            await engine.shutdown()

    with_adapter, base, listed = asyncio.run(run())
    assert prompt_ids is not None
    expected, _ = hf_greedy(oracle, prompt_ids, NEW_TOKENS)
    assert with_adapter == expected
    with oracle.disable_adapter():
        base_expected, _ = hf_greedy(oracle, prompt_ids, NEW_TOKENS)
    assert base == base_expected != expected
    assert [lora.lora_name for lora in listed] == ["all8"]


def test_llm_mixed_batch_equals_each_request_alone(
    tiny_model_dir: pathlib.Path, tiny_adapters: dict[str, pathlib.Path]
) -> None:
    """Base + two adapters interleaved in one batch; each equals the same prompt run alone
    with its adapter (and the adapters change the output)."""
    a = LoRARequest("all8", 1, str(tiny_adapters["all8"]))
    b = LoRARequest("qv16", 2, str(tiny_adapters["qv16"]))
    plan = [(PROMPTS[0], a), (PROMPTS[0], None), (PROMPTS[0], b), (PROMPTS[1], b),
            (PROMPTS[2], None), (PROMPTS[1], a)]  # fmt: skip
    with LLM(config=lora_config(tiny_model_dir)) as llm:  # type: ignore[arg-type]
        mixed = llm.generate([p for p, _ in plan], GREEDY, lora_request=[r for _, r in plan])
        alone = [llm.generate(p, GREEDY, lora_request=r)[0] for p, r in plan]
        assert [m.outputs[0].token_ids for m in mixed] == [o.outputs[0].token_ids for o in alone]
        first = [mixed[i].outputs[0].token_ids for i in range(3)]
        assert len({tuple(t) for t in first}) == 3  # base, a and b all differ on one prompt
        assert llm.metrics().adapter_requests_total == {"all8": 4, "qv16": 4}


def test_lora_disabled_refuses_an_adapter(tiny_model_dir: pathlib.Path) -> None:
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        request = llm.engine.request_builder.build(PROMPTS[0], GREEDY, adapter="x")
        with pytest.raises(RequestRejected, match="LoRA is not enabled"):
            llm.engine.add_request(request)
        with pytest.raises(RequestRejected, match="LoRA is not enabled"):
            llm.add_lora(LoRARequest("x", 1, "/nonexistent"))
        assert not llm.engine.has_unfinished()


def test_chat_and_flat_settings(
    tiny_model_dir: pathlib.Path, tiny_adapters: dict[str, pathlib.Path]
) -> None:
    """`LLM(enable_lora=True, max_loras=..., max_lora_rank=...)` as vLLM spells it; `chat` with
    an adapter equals `generate` of the same rendered prompt with it."""
    a = LoRARequest("all8", 1, str(tiny_adapters["all8"]))
    messages = [{"role": "user", "content": "Name a colour."}]
    with LLM(
        str(tiny_model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, block_size=8,
        num_device_blocks=64, num_cpu_blocks=8,
    ) as llm:  # fmt: skip
        chat = llm.chat(messages, GREEDY, lora_request=a)[0]
        plain = llm.chat(messages, GREEDY)[0]
        ids = {"prompt_token_ids": chat.prompt_token_ids}
        again = llm.generate(ids, GREEDY, lora_request=a)[0]
        assert chat.outputs[0].token_ids == again.outputs[0].token_ids
        assert chat.outputs[0].token_ids != plain.outputs[0].token_ids
        assert [lora.lora_name for lora in llm.list_loras()] == ["all8"]


def test_structured_outputs_with_adapters(
    tiny_model_dir: pathlib.Path, tiny_adapters: dict[str, pathlib.Path]
) -> None:
    """A constrained request under an adapter follows its regex, in a batch with a constrained
    base request and an unconstrained adapter request that equals its run alone."""
    import re

    from cluster.engine.structured_outputs import StructuredOutputsParams

    a = LoRARequest("all8", 1, str(tiny_adapters["all8"]))
    regex = r"[a-f]{2,6}-[0-9]{2}"
    constrained = SamplingParams(
        temperature=1.0, seed=3, max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex=regex),
    )  # fmt: skip
    with LLM(config=lora_config(tiny_model_dir)) as llm:  # type: ignore[arg-type]
        alone = llm.generate(PROMPTS[1], GREEDY, lora_request=a)[0].outputs[0].token_ids
        mixed = llm.generate(
            [PROMPTS[0], PROMPTS[0], PROMPTS[1]],
            [constrained, constrained, GREEDY],
            lora_request=[a, None, a],
        )
    assert all(re.fullmatch(regex, m.outputs[0].text) for m in mixed[:2])
    assert mixed[2].outputs[0].token_ids == alone
