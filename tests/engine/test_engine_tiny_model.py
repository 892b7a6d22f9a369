"""The engine on the real workers with the tiny Llama: greedy outputs are identical under every
memory regime (and equal HF transformers' greedy decode), every step's integrity is checked and
every block is free at the end."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import pytest
import torch
import transformers

from cluster.engine.errors import RequestRejected
from cluster.engine.llm import LLM
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from tests.engine.tiny_engine import (
    GREEDY,
    PREEMPTING,
    PROMPTS,
    assert_all_free,
    greedy_ids,
    tiny_config,
)

CASES: dict[str, dict[str, dict[str, Any]]] = {
    **PREEMPTING,
    "chunked": {"scheduler": {"max_num_batched_tokens": 8, "max_num_seqs": 4}},
    "prefix_cache": {},
}


def test_roomy_pool_matches_hf_greedy(
    tiny_hf: transformers.PreTrainedModel, roomy_outputs: list[RequestOutput]
) -> None:
    model = tiny_hf
    for output in roomy_outputs:
        ids = torch.tensor([output.prompt_token_ids])
        with torch.no_grad():
            expected = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, ids.shape[1] :].tolist()
        assert output.outputs[0].token_ids == expected
        assert output.outputs[0].finish_reason == "length"
        completion = output.outputs[0]  # an offline result is one delta covering everything
        assert completion.delta_token_ids == completion.token_ids
        assert completion.delta_text == completion.text != ""


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_identical_under_memory_regimes(
    tiny_model_dir: pathlib.Path, roomy_outputs: list[RequestOutput], case: str
) -> None:
    with LLM(config=tiny_config(tiny_model_dir, **CASES[case])) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        assert greedy_ids(outputs) == greedy_ids(roomy_outputs)
        assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in roomy_outputs]
        metrics = llm.metrics()
        if case == "recompute":
            assert metrics.preemptions_recompute >= 3
        if case == "swap":
            assert metrics.preemptions_swap >= 2 and metrics.pressure.swap_in_blocks > 0
        if case == "prefix_cache":
            assert metrics.prefix_cache_hit_rate == 0.0
            again = llm.generate(PROMPTS, GREEDY)
            assert greedy_ids(again) == greedy_ids(roomy_outputs)
            assert llm.metrics().prefix_cache_hit_rate > 0
            assert sum(o.num_cached_tokens for o in again) > 0
        assert_all_free(llm)


def test_parallel_sampling_on_the_real_workers(tiny_model_dir: pathlib.Path) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, logprobs=2)
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        core = llm.engine
        request = core.add_request(core.request_builder.build(PROMPTS[3], params))
        core.step()  # one prefill for all four branches, then the fork
        core.step()  # each branch writes its own tail (copy-on-write)
        pressure = core.block_manager.pressure()
        prompt_blocks = -(-len(request.prompt_token_ids) // core.block_manager.block_size)
        assert pressure.device.used < 4 * prompt_blocks
        assert pressure.device.used <= prompt_blocks + 4 and pressure.cow_copies >= 3
        while core.has_unfinished():
            outputs = core.step()
        texts = [o.text for o in outputs[0].outputs]
        assert len(set(texts)) == 4
        for completion in outputs[0].outputs:
            assert completion.logprobs is not None and len(completion.logprobs) == 8
            assert all(lp.logprob is not None and lp.logprob <= 0 for lp in completion.logprobs)
            assert completion.cumulative_logprob == pytest.approx(
                sum(lp.logprob for lp in completion.logprobs)
            )
        again = llm.generate([PROMPTS[3]], params)[0]
        assert [o.text for o in again.outputs] == texts
        assert_all_free(llm)


def test_stop_string_spanning_tokens_on_the_real_workers(
    tiny_model_dir: pathlib.Path, roomy_outputs: list[RequestOutput]
) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    output = max(roomy_outputs, key=lambda o: len(o.outputs[0].text))
    ids = output.outputs[0].token_ids
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    boundary = next(len(p) for p in pieces if len(p) >= 4)
    text = output.outputs[0].text
    stop = text[boundary - 2 : boundary + 2]  # the last 2 chars of one token, 2 of the next
    assert len(stop) == 4
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        prompt = {"prompt_token_ids": output.prompt_token_ids}
        stopped = llm.generate(prompt, dataclasses.replace(GREEDY, stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[: text.find(stop)]


def test_logprobs_read_as_vllms_dict_per_position_and_equal_hf(
    tiny_model_dir: pathlib.Path, tiny_hf: transformers.PreTrainedModel
) -> None:
    """`completion.logprobs[i]` reads as vLLM's `dict[int, Logprob]`: the sampled token first,
    then the top alternatives by rank, each value with `.logprob` and `.rank`; the numbers are
    HF transformers' log-softmax over the same tokens."""
    top_k = 3
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=top_k)
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        (output,) = llm.generate([PROMPTS[1]], params)
    completion = output.outputs[0]
    ids = output.prompt_token_ids + completion.token_ids
    with torch.no_grad():
        logits = tiny_hf(torch.tensor([ids])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)[len(output.prompt_token_ids) - 1 : -1]
    assert completion.logprobs is not None and len(completion.logprobs) == len(reference)
    for token_id, position, expected in zip(
        completion.token_ids, completion.logprobs, reference, strict=True
    ):
        assert next(iter(position)) == token_id  # the sampled token first, as vLLM orders it
        assert position[token_id].rank == 1  # greedy: the most likely token
        assert position[token_id].logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
        best = torch.topk(expected, top_k)
        assert list(position) == best.indices.tolist()
        assert [entry.rank for entry in position.values()] == list(range(1, top_k + 1))
        for token, logprob in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            assert position[token].logprob == pytest.approx(logprob, abs=1e-4)
        assert 10**9 not in position and len(dict(position)) == top_k


def test_vllms_offline_calls_work_as_with_vllm(tiny_model_dir: pathlib.Path) -> None:
    """vLLM's text and token prompt dicts, `use_tqdm`, `get_tokenizer` and
    `SamplingParams.clone` (a script written for vLLM's `LLM` runs unchanged)."""
    text = PROMPTS[1]
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        tokenizer = llm.get_tokenizer()
        ids = tokenizer(text)["input_ids"]
        plain, as_text, as_ids = llm.generate(
            [text, {"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False
        )
        (chatted,) = llm.chat([{"role": "user", "content": text}], GREEDY, use_tqdm=True)
        with pytest.raises(RequestRejected, match="'prompt' must be a string"):
            llm.generate({"prompt": ids})
        assert_all_free(llm)
    assert plain.prompt_token_ids == as_text.prompt_token_ids == as_ids.prompt_token_ids == ids
    assert as_text.prompt == text and as_ids.prompt is None
    assert plain.outputs[0].token_ids == as_text.outputs[0].token_ids == as_ids.outputs[0].token_ids
    assert len(chatted.outputs[0].token_ids) == GREEDY.max_tokens
    params = SamplingParams(stop=["x"], max_tokens=3)
    twin = params.clone()
    twin.stop.append("y")
    assert params.stop == ["x"] and twin == SamplingParams(stop=["x", "y"], max_tokens=3)
