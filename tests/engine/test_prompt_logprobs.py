"""vLLM's `prompt_logprobs` on the real workers with the tiny Llama.

Oracle: HF transformers' forward pass over the same float32 weights: the log-softmax of the
logits at position i - 1 gives prompt token i's log-probability and the top alternatives. The
engine must give them for every prompt token whatever splits or repeats the prompt's
computation: chunked prefill, preemption by recompute and by swap, a prompt whose blocks are in
the prefix cache (it is computed anyway), parallel branches, speculation and async scheduling,
offline and streamed as deltas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
from typing import Any

import pytest
import torch

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.errors import RequestRejected
from cluster.engine.llm import LLM
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from tests.engine.streams import engine_outputs
from tests.engine.test_sampling_penalties import REGIMES
from tests.engine.test_speculative_decoding import REPEATING
from tests.engine.tiny_engine import GREEDY, PROMPTS, assert_all_free, tiny_config

TOP = 3
WITH_PROMPT = dataclasses.replace(GREEDY, prompt_logprobs=TOP)
LONG_PROMPTS = [p for p in PROMPTS + REPEATING if len(p) > 12]
CHUNKED = {"scheduler": {"max_num_batched_tokens": 16, "max_num_seqs": 4}}


@pytest.fixture(scope="module")
def hf_model(tiny_hf: Any) -> Any:
    return tiny_hf


def hf_prompt_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """`[len(ids) - 1, vocab]`: row i - 1 is the distribution prompt token i was drawn from."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].to(torch.float32)
    return torch.log_softmax(logits, dim=-1)[:-1]


def assert_matches_hf(model: Any, output: RequestOutput, top: int = TOP) -> None:
    ids = output.prompt_token_ids
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(ids), output.prompt
    assert entries[0] is None
    reference = hf_prompt_logprobs(model, ids)
    for i in range(1, len(ids)):
        entry = entries[i]
        assert entry is not None
        expected = reference[i - 1]
        assert entry[ids[i]].logprob == pytest.approx(float(expected[ids[i]]), abs=1e-4)
        alternatives = {t: lp.logprob for t, lp in entry.items() if lp.rank is not None}
        assert len(alternatives) == top
        best = torch.topk(expected, top).values.tolist()
        assert sorted(alternatives.values(), reverse=True) == pytest.approx(best, abs=1e-4)
        for token, logprob in alternatives.items():
            assert logprob == pytest.approx(float(expected[token]), abs=1e-4)


@pytest.mark.parametrize("regime", ["chunked", *sorted(REGIMES)])
def test_prompt_logprobs_equal_hf_under_every_regime(
    tiny_model_dir: pathlib.Path, hf_model: Any, regime: str
) -> None:
    sections = CHUNKED if regime == "chunked" else REGIMES[regime]
    with LLM(config=tiny_config(tiny_model_dir, **sections)) as llm:
        plain = llm.generate(LONG_PROMPTS, GREEDY)
        outputs = llm.generate(LONG_PROMPTS, WITH_PROMPT)
        again = llm.generate(LONG_PROMPTS, WITH_PROMPT)
        metrics = llm.metrics()
        assert_all_free(llm)
    if regime == "recompute":
        assert metrics.preemptions_recompute >= 1
    if regime == "swap":
        assert metrics.preemptions_swap >= 1
    for output, repeat, base in zip(outputs, again, plain, strict=True):
        assert_matches_hf(hf_model, output)
        assert repeat.num_cached_tokens == 0  # computed again, never read from the cache
        assert [e and dict(e) for e in repeat.prompt_logprobs or []] == [
            e and dict(e) for e in output.prompt_logprobs or []
        ]
        assert output.outputs[0].token_ids == base.outputs[0].token_ids  # generation unchanged
        assert base.prompt_logprobs is None


def test_zero_alternatives_parallel_branches_and_a_one_token_prompt(
    tiny_model_dir: pathlib.Path, hf_model: Any
) -> None:
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        [own] = llm.generate(PROMPTS[1], dataclasses.replace(GREEDY, prompt_logprobs=0))
        [forked] = llm.generate(PROMPTS[1], dataclasses.replace(WITH_PROMPT, n=3))
        [single] = llm.generate(
            {"prompt_token_ids": [17]}, dataclasses.replace(GREEDY, prompt_logprobs=2)
        )
    assert_matches_hf(hf_model, own, top=0)
    assert all(len(entry) == 1 for entry in own.prompt_logprobs[1:])  # type: ignore[index, arg-type]
    assert_matches_hf(hf_model, forked)
    assert len(forked.outputs) == 3
    assert single.prompt_logprobs == [None]


def test_streamed_deltas_carry_the_prompt_logprobs_once(
    tiny_model_dir: pathlib.Path, hf_model: Any
) -> None:
    async def scenario() -> list[list[RequestOutput]]:
        engine = AsyncEngine(tiny_config(tiny_model_dir, **CHUNKED))
        try:
            streams = [
                engine_outputs(engine, engine.request_builder.build(prompt, WITH_PROMPT))
                for prompt in LONG_PROMPTS
            ]
            return list(
                await asyncio.gather(*[_collect(stream) for stream in streams])  # type: ignore[arg-type]
            )
        finally:
            await engine.shutdown()

    for outputs in asyncio.run(scenario()):
        assert_matches_hf(hf_model, outputs[-1])
        assert outputs[0].prompt_logprobs is not None  # the first token's delta has them


async def _collect(stream: Any) -> list[RequestOutput]:
    return [output async for output in stream]


def test_bad_values_and_a_prefill_only_request_are_refused(tiny_model_dir: pathlib.Path) -> None:
    for bad in (-1, 21, True, 1.0):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        request = llm.engine.request_builder.build(PROMPTS[1], WITH_PROMPT)
        with pytest.raises(RequestRejected, match="prompt_logprobs"):
            llm.engine.add_request(dataclasses.replace(request, prefill_only=True))
