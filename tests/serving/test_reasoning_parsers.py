"""The reasoning split on text: each parser's cases against a hand-written oracle, content never
holding the thinking span, and any chunking of a stream adding up to the unary split."""

from __future__ import annotations

import random

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
