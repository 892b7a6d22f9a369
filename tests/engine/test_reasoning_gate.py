"""A structured-outputs constraint waits for the end of the thinking span (`ThinkingGrammar`),
and `chat_template_kwargs` reach the chat template: over xgrammar's own matcher token by token,
and in the engine with the tiny Qwen3 whose tokenizer has `<think>`/`</think>` tokens, where the
unconstrained run of the same request is the oracle of the free span."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from cluster.engine.engine_core import EngineCore
from cluster.engine.llm import LLM
from cluster.engine.reasoning import ThinkingGrammar, ThinkingTags, ThinkingTokens
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import StructuredOutputsParams
from tests.engine.tiny_engine import tiny_config

CHOICES = ["yes", "no"]
QUESTION = [{"role": "user", "content": "Is the sky blue?"}]
END_BIAS = 2.5
"""A bias on `</think>` under which the tiny model thinks a few tokens, then ends the span."""


@pytest.fixture(scope="module")
def thinker(tiny_thinker_dir: pathlib.Path) -> Any:
    with LLM(config=tiny_config(tiny_thinker_dir)) as llm:
        yield llm


def tag_ids(llm: LLM) -> tuple[int, int]:
    tokenizer = llm.get_tokenizer()
    (start,) = tokenizer.encode("<think>", add_special_tokens=False)
    (end,) = tokenizer.encode("</think>", add_special_tokens=False)
    return start, end


@pytest.fixture(scope="module")
def compiled_choice(thinker: LLM) -> Any:
    """The `choice` constraint compiled for the thinker's vocabulary (the engine's cache)."""
    return thinker.engine.grammars.compile(StructuredOutputsParams(choice=CHOICES).spec)


def choice_gate(llm: LLM, compiled: Any, opening: str) -> tuple[ThinkingGrammar, Any]:
    """A gate over a fresh `choice` matcher, and a second matcher to read the grammar's masks."""
    start, end = tag_ids(llm)
    tokens = ThinkingTokens(start, end, opening)  # type: ignore[arg-type]
    return ThinkingGrammar(compiled.new_matcher(), tokens), compiled.new_matcher()


def allowed(masks: Any, token: int) -> bool:
    word, bit = divmod(token, 32)
    return bool((int(masks[0, word]) >> bit) & 1)


def test_the_span_is_free_and_the_answer_constrained(thinker: LLM, compiled_choice: Any) -> None:
    start, end = tag_ids(thinker)
    free_token = thinker.get_tokenizer().encode(" divide", add_special_tokens=False)[0]
    gate, grammar = choice_gate(thinker, compiled_choice, "thinking")
    assert gate.bitmasks() is None  # thinking: no mask
    assert gate.accept(free_token) and gate.accept(start)  # anything while thinking
    assert gate.valid_drafts([free_token, end, free_token]) == 1  # drafts stop at the end tag
    assert gate.accept(end)
    masks = gate.bitmasks()
    assert masks is not None and (masks == grammar.bitmasks()).all()  # the grammar's first
    assert not allowed(masks, free_token) and not gate.accept(free_token)
    yes = thinker.get_tokenizer().encode("yes", add_special_tokens=False)
    assert all(gate.accept(token) for token in yes)
    replayed, _ = choice_gate(
        thinker, compiled_choice, "thinking"
    )  # recompute: the state from the tokens
    replayed.sync([free_token, start, end, *yes])
    assert (replayed.bitmasks() == gate.bitmasks()).all()


def test_undecided_lets_the_first_token_open_a_span(thinker: LLM, compiled_choice: Any) -> None:
    start, _ = tag_ids(thinker)
    gate, grammar = choice_gate(thinker, compiled_choice, "undecided")
    masks = gate.bitmasks()
    expected = grammar.bitmasks()
    assert masks is not None and allowed(masks, start) and not allowed(expected, start)
    assert [allowed(masks, t) for t in range(masks.shape[1] * 32) if t != start] == [
        allowed(expected, t) for t in range(masks.shape[1] * 32) if t != start
    ]
    assert gate.accept(start) and gate.bitmasks() is None
    answering, _ = choice_gate(thinker, compiled_choice, "undecided")
    (y,) = thinker.get_tokenizer().encode("y", add_special_tokens=False)[:1]
    assert answering.accept(y) and not allowed(answering.bitmasks(), start)


def run(engine: EngineCore, **build: Any) -> str:
    request = engine.add_request(engine.request_builder.build(QUESTION, **build))
    while not request.finished:
        engine.step()
    return request.make_output().outputs[0].text


def test_the_engine_thinks_freely_then_answers_a_choice(thinker: LLM) -> None:
    """DeepSeek-R1's tags (its output opens inside the span): unconstrained, the tiny model
    thinks a few tokens, ends the span, then rambles; constrained, the span is the same text and
    the answer one of the choices."""
    _, end = tag_ids(thinker)
    tags = ThinkingTags(always_thinks=True)
    bias = {end: END_BIAS}
    free = run(
        thinker.engine,
        params=SamplingParams(temperature=0.0, max_tokens=12, logit_bias=bias),
        thinking=tags,
    )
    span, _, rambling = free.partition("</think>")
    assert span and rambling not in CHOICES
    constrained = run(
        thinker.engine,
        params=SamplingParams(
            temperature=0.0,
            max_tokens=12,
            logit_bias=bias,
            structured_outputs=StructuredOutputsParams(choice=CHOICES),
        ),
        thinking=tags,
    )
    thought, tag, answer = constrained.partition("</think>")
    assert (thought, tag) == (span, "</think>") and answer in CHOICES
    without_gate = run(
        thinker.engine,
        params=SamplingParams(
            temperature=0.0,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(choice=CHOICES),
        ),
    )
    assert without_gate in CHOICES  # no parser: constrained from the first token


def test_enable_thinking_false_reaches_the_template_and_closes_the_span(thinker: LLM) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=CHOICES)
    )
    closed = thinker.chat(
        QUESTION, params, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False
    )[0]
    assert closed.prompt is not None and closed.prompt.endswith("<think>\n\n</think>\n\n")
    plain = thinker.chat(QUESTION, params, use_tqdm=False)[0]
    assert plain.prompt is not None and "<think>" not in plain.prompt
    answer = run(
        thinker.engine,
        params=params,
        chat_template_kwargs={"enable_thinking": False},
        thinking=ThinkingTags(always_thinks=True),  # the prompt closed the span: answering
    )
    assert answer in CHOICES


def test_tags_that_are_not_one_token_refuse_a_constraint(thinker: LLM) -> None:
    from cluster.engine.errors import RequestRejected

    params = SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(choice=CHOICES)
    )
    with pytest.raises(RequestRejected, match="not one"):
        run(thinker.engine, params=params, thinking=ThinkingTags("<reason>", "</reason>"))
