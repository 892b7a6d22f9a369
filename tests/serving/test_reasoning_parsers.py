"""The reasoning split on text: each parser's cases against a hand-written oracle, content never
holding the thinking span, and any chunking of a stream adding up to the unary split."""

from __future__ import annotations

import random
import types

import pytest

from cluster.engine.reasoning import ThinkingTags
from cluster.serving.reasoning_parsers import REASONING_PARSERS, ReasoningSplit, split_reasoning

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek_r1"]

CASES = [
    # (tags, opening, output, reasoning, content)
    (QWEN3, "undecided", "<think>step one</think>\n\nThe answer.", "step one", "\n\nThe answer."),
    (QWEN3, "undecided", "  <think>a</think>b", "a", "b"),
    (QWEN3, "undecided", "No thinking here.", None, "No thinking here."),
    (QWEN3, "undecided", "<thin", None, "<thin"),  # a partial tag at the end is text
    (QWEN3, "undecided", "<think>never closed", "never closed", ""),
    (QWEN3, "undecided", "x</think>y", None, "x</think>y"),  # no span opened: all content
    (QWEN3, "thinking", "r</think>c", "r", "c"),
    (QWEN3, "thinking", "<think>r</think>c", "r", "c"),  # the start tag written again
    (QWEN3, "answering", "<think>kept</think>", None, "<think>kept</think>"),
    (R1, "thinking", "why</think>because", "why", "because"),
    (R1, "thinking", "still thinking </thi", "still thinking </thi", ""),
    (R1, "thinking", "a</think>b</think>c", "a", "b</think>c"),  # only the first end tag
    (R1, "thinking", "", "", ""),
]


@pytest.mark.parametrize(("tags", "opening", "output", "reasoning", "content"), CASES)
def test_split_matches_the_cases(
    tags: ThinkingTags, opening: str, output: str, reasoning: str | None, content: str
) -> None:
    assert split_reasoning(output, tags, opening) == (reasoning, content)  # type: ignore[arg-type]


@pytest.mark.parametrize(("tags", "opening", "output", "reasoning", "content"), CASES)
def test_any_chunking_streams_the_same_split(
    tags: ThinkingTags, opening: str, output: str, reasoning: str | None, content: str
) -> None:
    rng = random.Random(output)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(output) + 1), k=min(len(output) + 1, 4)))
        pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)], strict=True)]
        splitter = ReasoningSplit(tags, opening)  # type: ignore[arg-type]
        got_reasoning, got_content = "", ""
        for piece in [*pieces, None]:
            out = splitter.feed(piece) if piece is not None else splitter.finish()
            got_reasoning += out.reasoning
            got_content += out.content
            assert "<think>" not in out.content or "<think>" in (content or "")
        assert got_reasoning == (reasoning or "")
        assert got_content == content


def test_a_tag_split_across_pieces_is_never_streamed_as_text() -> None:
    splitter = ReasoningSplit(QWEN3, "undecided")
    outs = [splitter.feed(p) for p in ["<th", "ink>plan", "ning</", "think>", "done"]]
    assert [(o.reasoning, o.content) for o in outs] == [
        ("", ""),
        ("plan", ""),
        ("ning", ""),
        ("", ""),
        ("", "done"),
    ]


def test_openings_follow_the_prompt_end() -> None:
    assert QWEN3.opening("<|im_start|>assistant\n") == "undecided"
    assert QWEN3.opening("<|im_start|>assistant\n<think>\n") == "thinking"
    assert QWEN3.opening("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "answering"
    assert R1.opening("<｜Assistant｜>") == "thinking"
    assert R1.opening("<｜Assistant｜><think>\n\n</think>\n\n") == "answering"


class _Renderer:
    """Decodes the fake prompt ids 1 and 2 as a template that opened the span and one that did
    not (what `ThinkingTags.opening_of` reads); its tokenizer has no chat template of its own,
    so tools take the fallback template's `hermes` parser."""

    tokenizer = types.SimpleNamespace(chat_template=None)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return {1: "<|im_start|>assistant\n<think>\n", 2: "<|im_start|>assistant\n"}[ids[-1]]


class _FrontEnd:
    renderer = _Renderer()


TEXT = (
    'I could call <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    '</think>Calling. <tool_call>{"name": "g", "arguments": {}}</tool_call>'
)


@pytest.mark.parametrize("pieces", [[TEXT], [TEXT[:20], TEXT[20:70], TEXT[70:90], TEXT[90:]]])
def test_tool_calls_are_read_from_the_answer_only(pieces: list[str]) -> None:
    """A call written inside the thinking span is reasoning, not a call: unary and streamed,
    only `g` (after `</think>`) comes back, and the content holds no span text."""
    from cluster.engine.output_stream import BranchDelta, RequestDelta
    from cluster.engine.outputs import CompletionOutput
    from cluster.serving.openai_serving import ChatChunks, OpenAIServing
    from cluster.serving.reasoning_parsers import ReasoningStream
    from cluster.serving.tool_calls import ToolDef, ToolSettings, plan_tools

    tools = [ToolDef.model_validate({"type": "function", "function": {"name": n}}) for n in "fg"]
    plan = plan_tools(tools, "auto", None, ToolSettings(True, "hermes"))
    assert plan is not None
    serving = OpenAIServing(_FrontEnd(), "m", ToolSettings(True, "hermes"), R1)  # type: ignore[arg-type]
    output = CompletionOutput(0, TEXT, [], finish_reason="stop")
    message, reason = serving.assistant_message(output, plan, [1])
    assert reason == "tool_calls" and message.reasoning_content is not None
    assert [c.function.name for c in message.tool_calls or []] == ["g"]
    assert message.reasoning_content.startswith("I could call <tool_call>")
    assert "Calling." in (message.content or "") and "I could" not in (message.content or "")

    encoder = ChatChunks(serving, "r", "m", plan.stream(), ReasoningStream(R1, serving.decode))
    names, reasoning = [], ""
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        branch = BranchDelta(0, piece, finish_reason="stop" if last else None)
        delta = RequestDelta("r", [branch], last, 0, prompt_token_ids=[1] if i == 0 else None)
        for chunk in encoder.chunks(0, delta):
            for choice in chunk.choices:  # type: ignore[attr-defined]
                reasoning += choice.delta.reasoning_content or ""
                assert "I could" not in (choice.delta.content or "")
                names += [c.function.name for c in choice.delta.tool_calls or [] if c.function.name]
    assert names == ["g"] and reasoning == message.reasoning_content


def test_without_a_span_opening_the_text_is_all_answer() -> None:
    from cluster.engine.outputs import CompletionOutput
    from cluster.serving.openai_serving import OpenAIServing

    serving = OpenAIServing(_FrontEnd(), "m", None, QWEN3)  # type: ignore[arg-type]
    output = CompletionOutput(0, "plain answer", [], finish_reason="stop")
    message, _ = serving.assistant_message(output, None, [2])
    assert (message.content, message.reasoning_content) == ("plain answer", None)
