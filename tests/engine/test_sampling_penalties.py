"""vLLM's penalties, logit bias, min-p and min_tokens on the real workers with the tiny Llama.

Oracle: HF transformers' greedy `generate` over the same weights with HF's own logits processors
(repetition penalty, sequence bias, min new tokens) and OpenAI's frequency and presence
penalties written out plainly, in vLLM's order. The engine must give the oracle's tokens under
every memory regime (preemption by recompute and by swap, prefix-cache hits), with n-gram
speculation and with async scheduling: every path that changes which tokens a rank has seen.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import pytest
import torch
from transformers import (
    LogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from cluster.engine.errors import RequestRejected
from cluster.engine.llm import LLM
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from tests.engine.test_speculative_decoding import NGRAM, REPEATING
from tests.engine.tiny_engine import (
    GREEDY,
    PREEMPTING,
    PROMPTS,
    MemoizedOracle,
    assert_all_free,
    hf_greedy_tokens,
    tiny_config,
)

PENALIZED = dataclasses.replace(
    GREEDY,
    repetition_penalty=1.4,
    frequency_penalty=0.8,
    presence_penalty=0.5,
    logit_bias={5: 2, 11: -1.5},  # an int bias too, as users write them
)
ENCOURAGED = dataclasses.replace(
    GREEDY, repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=-1.0
)
"""Penalties below neutral: repetition is rewarded, so n-gram drafts are proposed and kept."""
PARAMS = {"penalized": PENALIZED, "encouraged": ENCOURAGED}
REGIMES: dict[str, dict[str, dict[str, Any]]] = {
    "roomy": {},
    **PREEMPTING,
    "speculation": {"speculative": NGRAM},
    "async_scheduling": {"scheduler": {"async_scheduling": True}},
}


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties over the generated tokens only."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        for row, ids in enumerate(input_ids):
            for token in set(ids[self.prompt_len :].tolist()):
                count = ids[self.prompt_len :].tolist().count(token)
                scores[row, token] -= self.frequency * count + self.presence
        return scores


def hf_greedy(model: Any, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """HF's greedy tokens with `params`' processors, in vLLM's order: bias, the min-tokens
    ban, the repetition penalty, the frequency and presence penalties."""
    processors: list[LogitsProcessor] = []
    if params.logit_bias:
        processors.append(
            SequenceBiasLogitsProcessor({(t,): float(b) for t, b in params.logit_bias.items()})
        )
    if params.min_tokens:
        processors.append(
            MinNewTokensLengthLogitsProcessor(
                len(prompt_ids), params.min_tokens, params.stop_token_ids
            )
        )
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        processors.append(
            OpenAIPenalties(len(prompt_ids), params.frequency_penalty, params.presence_penalty)
        )
    return hf_greedy_tokens(
        model, prompt_ids, params.max_tokens or 0, processors, params.stop_token_ids
    )


@pytest.fixture(scope="module")
def hf_model(tiny_hf: Any) -> Any:
    return tiny_hf


@pytest.fixture(scope="module")
def oracle(hf_model: Any) -> MemoizedOracle:
    """`hf_greedy` on the tiny model, each (prompt, params) answered once for all the regimes."""
    return MemoizedOracle(functools.partial(hf_greedy, hf_model))


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir: pathlib.Path) -> list[RequestOutput]:
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        return llm.generate(PROMPTS + REPEATING, GREEDY)


@pytest.mark.parametrize("kind", sorted(PARAMS))
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_penalized_greedy_equals_hf_under_every_regime(
    tiny_model_dir: pathlib.Path,
    oracle: MemoizedOracle,
    plain_outputs: list[RequestOutput],
    regime: str,
    kind: str,
) -> None:
    prompts = PROMPTS + REPEATING
    params = PARAMS[kind]
    with LLM(config=tiny_config(tiny_model_dir, **REGIMES[regime])) as llm:
        outputs = llm.generate(prompts, params)
        for output in outputs:
            expected = oracle(output.prompt_token_ids, params)
            assert output.outputs[0].token_ids == expected, output.prompt
        metrics = llm.metrics()
        if regime == "recompute":
            assert metrics.preemptions_recompute >= 1
        if regime == "swap":
            assert metrics.preemptions_swap >= 1
        if regime == "speculation" and kind == "encouraged":
            assert metrics.speculation is not None
            assert metrics.speculation.num_accepted_tokens > 0
        assert_all_free(llm)
    changed = sum(
        o.outputs[0].token_ids != p.outputs[0].token_ids
        for o, p in zip(outputs, plain_outputs, strict=True)
    )
    assert changed >= len(prompts) // 2  # the penalties are not ignored


def test_prefix_cache_hits_still_penalize_the_cached_prompt_tokens(
    tiny_model_dir: pathlib.Path, hf_model: Any
) -> None:
    """The second pass starts each prompt after its cached blocks: the rank never computes those
    tokens, yet the repetition penalty must count them."""
    params = dataclasses.replace(GREEDY, repetition_penalty=2.0)
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        first = llm.generate(PROMPTS, params)
        again = llm.generate(PROMPTS, params)
        assert sum(o.num_cached_tokens for o in again) > 0
    for a, b in zip(first, again, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.outputs[0].token_ids == hf_greedy(hf_model, b.prompt_token_ids, params)


def test_parallel_branches_penalize_their_own_outputs(
    tiny_model_dir: pathlib.Path, hf_model: Any
) -> None:
    """n = 3 greedy branches fork after the prompt; each must equal the one-branch oracle."""
    params = dataclasses.replace(PENALIZED, n=3)
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        [output] = llm.generate(PROMPTS[1], params)
    expected = hf_greedy(hf_model, output.prompt_token_ids, PENALIZED)
    assert [c.token_ids for c in output.outputs] == [expected] * 3


def test_min_tokens_holds_off_stop_tokens_and_stop_strings(
    tiny_model_dir: pathlib.Path, hf_model: Any, plain_outputs: list[RequestOutput]
) -> None:
    plain = plain_outputs[1].outputs[0]
    stop_id = plain.token_ids[2]
    early = dataclasses.replace(GREEDY, stop_token_ids=[stop_id])
    held = dataclasses.replace(early, min_tokens=6)
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        [stopped] = llm.generate(PROMPTS[1], early)
        [later] = llm.generate(PROMPTS[1], held)
        assert len(stopped.outputs[0].token_ids) == 3  # the stop token ends it at once
        tokens = later.outputs[0].token_ids
        assert len(tokens) > 6 and stop_id not in tokens[:6]
        assert tokens == hf_greedy(hf_model, later.prompt_token_ids, held)
        stop = plain.text[:4]  # found at the very start of the greedy text
        [text_held] = llm.generate(
            PROMPTS[1], dataclasses.replace(GREEDY, stop=[stop], min_tokens=5)
        )
    completion = text_held.outputs[0]
    assert len(completion.token_ids) > 5
    assert completion.token_ids == plain.token_ids[: len(completion.token_ids)]
    assert completion.text.startswith(stop)  # the early match was not a stop


def test_min_p_of_one_keeps_only_the_most_likely_token(
    tiny_model_dir: pathlib.Path, plain_outputs: list[RequestOutput]
) -> None:
    params = SamplingParams(temperature=1.0, min_p=1.0, seed=3, max_tokens=16, ignore_eos=True)
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        outputs = llm.generate(PROMPTS, params)
        loose = llm.generate(PROMPTS, dataclasses.replace(params, min_p=0.0))
    assert [o.outputs[0].token_ids for o in outputs] == [
        p.outputs[0].token_ids for p in plain_outputs[: len(PROMPTS)]
    ]
    assert [o.outputs[0].token_ids for o in loose] != [o.outputs[0].token_ids for o in outputs]


def test_out_of_range_parameters_are_refused(tiny_model_dir: pathlib.Path) -> None:
    for bad in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"repetition_penalty": 0.0},
        {"min_p": 1.5},
        {"min_tokens": -1},
        {"min_tokens": 20, "max_tokens": 10},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {1: float("nan")}},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        vocab = llm.engine.renderer.vocab_size
        with pytest.raises(RequestRejected, match="logit_bias"):
            llm.generate("x", SamplingParams(logit_bias={vocab: 1.0}))
