"""vLLM's `allowed_token_ids` and `bad_words` on the real workers with the tiny Llama.

Oracle: HF transformers' greedy `generate` over the same weights with two logits processors
written out plainly here: keep only the allowed ids; ban a bad word's last token when the
generated tokens (not the prompt) end with the rest of it. The bad words' token ids are read
with the HF tokenizer: the word as it starts a text, and after a space when that spelling is
other tokens. The engine must give the oracle's tokens under every memory regime, with n-gram
speculation and with async scheduling.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import pytest
import torch
import transformers
from transformers import LogitsProcessor

from cluster.engine.errors import RequestRejected
from cluster.engine.llm import LLM
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from tests.engine.test_sampling_penalties import REGIMES
from tests.engine.test_speculative_decoding import REPEATING
from tests.engine.tiny_engine import (
    GREEDY,
    PROMPTS,
    MemoizedOracle,
    assert_all_free,
    hf_greedy_tokens,
    tiny_config,
)

ALL_PROMPTS = PROMPTS + REPEATING


class AllowedOnly(LogitsProcessor):
    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        masked = torch.full_like(scores, float("-inf"))
        masked[:, self.allowed] = scores[:, self.allowed]
        return masked


class BadWordsInOutput(LogitsProcessor):
    def __init__(self, prompt_len: int, words: list[list[int]]) -> None:
        self.prompt_len, self.words = prompt_len, words

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        generated = input_ids[0, self.prompt_len :].tolist()
        for word in self.words:
            *head, last = word
            if not head or (len(generated) >= len(head) and generated[-len(head) :] == head):
                scores[0, last] = float("-inf")
        return scores


def bad_word_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    ids: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        ids.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced != bare:
            ids.append(spaced)
    return ids


def hf_greedy(
    model: Any, prompt_ids: list[int], params: SamplingParams, bad_ids: list[list[int]]
) -> list[int]:
    processors: list[LogitsProcessor] = []
    if params.allowed_token_ids:
        processors.append(AllowedOnly(params.allowed_token_ids))
    if bad_ids:
        processors.append(BadWordsInOutput(len(prompt_ids), bad_ids))
    return hf_greedy_tokens(model, prompt_ids, params.max_tokens or 0, processors)


@pytest.fixture(scope="module")
def hf_model(tiny_hf: Any) -> Any:
    return tiny_hf


@pytest.fixture(scope="module")
def oracle(hf_model: Any) -> MemoizedOracle:
    """`hf_greedy` on the tiny model, each (prompt, params, banned ids) answered once for all
    the regimes."""
    return MemoizedOracle(functools.partial(hf_greedy, hf_model))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: pathlib.Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir: pathlib.Path) -> list[RequestOutput]:
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        return llm.generate(ALL_PROMPTS, GREEDY)


def words_in(plain: list[RequestOutput], tokenizer: Any) -> list[str]:
    """Two-token words the plain greedy outputs contain, read back as the same two tokens (so a
    ban on them must change those outputs): one per output that has one, up to three."""
    words: list[str] = []
    for output in plain:
        tokens = output.outputs[0].token_ids
        for i in range(2, len(tokens) - 1):
            word = tokenizer.decode(tokens[i : i + 2])
            if word.strip() and tokens[i : i + 2] in bad_word_ids(tokenizer, [word]):
                words.append(word)
                break
        if len(words) == 3:
            break
    assert words, "no output holds a two-token word to ban"
    return words


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_bad_words_and_allowed_ids_equal_hf_under_every_regime(
    tiny_model_dir: pathlib.Path,
    oracle: MemoizedOracle,
    tokenizer: Any,
    plain_outputs: list[RequestOutput],
    regime: str,
) -> None:
    words = words_in(plain_outputs, tokenizer)
    bad_ids = bad_word_ids(tokenizer, words)
    seen = sorted({t for o in plain_outputs for t in o.outputs[0].token_ids})
    firsts = {o.outputs[0].token_ids[0] for o in plain_outputs}
    allowed = [t for t in seen if t not in firsts] + [7, 11]
    cases = {
        "bad_words": dataclasses.replace(GREEDY, bad_words=words),
        "allowed": dataclasses.replace(GREEDY, allowed_token_ids=allowed),
        "both": dataclasses.replace(GREEDY, bad_words=words, allowed_token_ids=seen),
    }
    with LLM(config=tiny_config(tiny_model_dir, **REGIMES[regime])) as llm:
        results = {name: llm.generate(ALL_PROMPTS, params) for name, params in cases.items()}
        assert_all_free(llm)
    for name, outputs in results.items():
        params = cases[name]
        banned = bad_ids if params.bad_words else []
        for output in outputs:
            tokens = output.outputs[0].token_ids
            assert tokens == oracle(output.prompt_token_ids, params, banned), (
                name,
                output.prompt,
            )
            assert not any(contains(tokens, word) for word in banned)
            if params.allowed_token_ids:
                assert set(tokens) <= set(params.allowed_token_ids)
        changed = [
            o.outputs[0].token_ids != p.outputs[0].token_ids
            for o, p in zip(outputs, plain_outputs, strict=True)
        ]
        assert sum(changed) >= (len(ALL_PROMPTS) if name == "allowed" else len(words)), name


def test_bad_and_allowed_parameters_are_checked(tiny_model_dir: pathlib.Path) -> None:
    for bad in (
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-1]},
        {"allowed_token_ids": ["a"]},
        {"bad_words": [""]},
        {"bad_words": ["  "]},
        {"bad_words": [3]},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(bad_words="word").bad_words == ["word"]
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        vocab = llm.engine.renderer.vocab_size
        with pytest.raises(RequestRejected, match="allowed_token_ids names token id"):
            llm.generate("x", SamplingParams(allowed_token_ids=[1, vocab]))
        [one] = llm.generate("x", SamplingParams(allowed_token_ids=[9], max_tokens=5))
        assert one.outputs[0].token_ids == [9] * 5
