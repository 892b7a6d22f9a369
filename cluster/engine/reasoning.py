"""A reasoning model's thinking span, as the engine and every front end see it.

`ThinkingTags` names the span's tags (`<think>` ... `</think>`) and whether a model writes the
span without being asked (DeepSeek-R1, whose template opens it in the prompt). `opening` reads
how an output begins from the end of its rendered prompt, the one rule both the text split
(`cluster.serving.reasoning_parsers`) and the grammar gate here follow:

- the prompt ends with the start tag: the output begins inside the span ("thinking");
- it ends with the end tag (a template that closed the span, e.g. Qwen3's
  `enable_thinking: false`): the output is all answer ("answering");
- otherwise "thinking" for a model that always thinks, else "undecided": the output is inside a
  span exactly when it begins with the start tag.

`ThinkingGrammar` makes a structured-outputs constraint (or a tool call's) apply only to the
answer: the span is free text, the grammar starts on the first token after the end tag. It is a
`TokenConstraint` like `BranchGrammar`, its state a function of the branch's output tokens
(so preemption, which keeps them, keeps it valid).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

Opening = Literal["thinking", "answering", "undecided"]

PROMPT_TAIL_TOKENS = 8
"""Prompt tokens decoded to read its end (the tags are single tokens in the models that use
them; a few more cover the whitespace a template writes after them)."""


@dataclass(frozen=True)
class ThinkingTags:
    """The thinking span's tags and whether the model thinks unasked (see the module doc)."""

    start: str = "<think>"
    end: str = "</think>"
    always_thinks: bool = False

    def opening(self, prompt_tail: str) -> Opening:
        """How an output begins, from the end of its rendered prompt (special tokens kept)."""
        tail = prompt_tail.rstrip()
        if tail.endswith(self.start):
            return "thinking"
        if tail.endswith(self.end):
            return "answering"
        return "thinking" if self.always_thinks else "undecided"

    def opening_of(
        self, prompt_token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]
    ) -> Opening:
        """`opening` of a prompt given as token ids; `decode` keeps special tokens."""
        return self.opening(decode(list(prompt_token_ids[-PROMPT_TAIL_TOKENS:])))


class TokenConstraint(Protocol):
    """What the engine asks of a branch's constraint (`BranchGrammar`, `ThinkingGrammar`)."""

    @property
    def is_terminated(self) -> bool: ...
    def accept(self, token_id: int) -> bool: ...
    def sync(self, output_token_ids: Sequence[int]) -> None: ...
    def valid_drafts(self, drafts: Sequence[int]) -> int: ...
    def bitmasks(self, drafts: Sequence[int] = ()) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class ThinkingTokens:
    """The tags as token ids, and how this request's output begins."""

    start_id: int
    end_id: int
    opening: Opening


class ThinkingGrammar:
    """`answer` (a branch's grammar) gated behind the thinking span: no mask while the branch
    thinks, the grammar from the token after the end tag. "undecided": the first token may be
    the start tag besides what the grammar allows; it decides whether a span follows.

    Invariant: `_tokens` are the branch's output tokens this gate has seen, and `answer` has
    accepted exactly those after the span (`_answer_start`)."""

    def __init__(self, answer: TokenConstraint, tokens: ThinkingTokens) -> None:
        self.answer = answer
        self.ids = tokens
        self._tokens: list[int] = []

    def _answer_start(self, tokens: Sequence[int]) -> int | None:
        """Where the answer begins in `tokens` (None: still thinking, or undecided and empty)."""
        opening = self.ids.opening
        if opening == "answering":
            return 0
        skip = 0
        if opening == "undecided":
            if not tokens:
                return None
            if tokens[0] != self.ids.start_id:
                return 0
            skip = 1
        for index in range(skip, len(tokens)):
            if tokens[index] == self.ids.end_id:
                return index + 1
        return None

    @property
    def is_terminated(self) -> bool:
        return self._answer_start(self._tokens) is not None and self.answer.is_terminated

    def accept(self, token_id: int) -> bool:
        start = self._answer_start(self._tokens)
        undecided = start is None and self.ids.opening == "undecided" and not self._tokens
        answers = start is not None or (undecided and token_id != self.ids.start_id)
        if answers and not self.answer.accept(token_id):
            return False
        self._tokens.append(token_id)
        return True

    def sync(self, output_token_ids: Sequence[int]) -> None:
        if len(self._tokens) == len(output_token_ids):
            return
        self._tokens = list(output_token_ids)
        start = self._answer_start(self._tokens)
        self.answer.sync(self._tokens[start:] if start is not None else [])

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        """While thinking, drafts up to (not with) the end tag: every row of the step is then
        free. Undecided: none. Answering: the grammar's."""
        start = self._answer_start(self._tokens)
        if start is not None:
            return self.answer.valid_drafts(drafts)
        if self.ids.opening == "undecided" and not self._tokens:
            return 0
        for count, token in enumerate(drafts):
            if token == self.ids.end_id:
                return count
        return len(drafts)

    def bitmasks(self, drafts: Sequence[int] = ()) -> torch.Tensor | None:
        """None (no mask) while thinking; undecided, the grammar's first mask with the start
        tag allowed too."""
        start = self._answer_start(self._tokens)
        if start is not None:
            return self.answer.bitmasks(drafts)
        if self.ids.opening == "undecided" and not self._tokens:
            masks = self.answer.bitmasks(())
            assert masks is not None
            word, bit = divmod(self.ids.start_id, 32)
            masks[0, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
            return masks
        return None


def thinking_tokens(
    tags: ThinkingTags,
    encode: Callable[[str], Sequence[int]],
    decode: Callable[[Sequence[int]], str],
    prompt_token_ids: Sequence[int],
) -> ThinkingTokens:
    """The tags' token ids (`encode` adds no special tokens; `decode` keeps them) and the
    prompt's opening. Raises ValueError when a tag is not one token of this tokenizer (the gate
    watches token ids)."""
    ids = []
    for tag in (tags.start, tags.end):
        encoded = list(encode(tag))
        if len(encoded) != 1:
            raise ValueError(
                f"the reasoning tag {tag!r} is {len(encoded)} tokens of this model's tokenizer, "
                "not one: structured outputs cannot wait for the end of its thinking"
            )
        ids.append(encoded[0])
    return ThinkingTokens(ids[0], ids[1], tags.opening_of(prompt_token_ids, decode))
