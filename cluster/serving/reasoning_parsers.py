"""`--reasoning-parser` (vLLM's names): a reasoning model's thinking span split off its answer.

`REASONING_PARSERS` maps each name to its `ThinkingTags` (`cluster.engine.reasoning`, which
also says how an output begins from its prompt). `ReasoningSplit` is the one splitter: fed an
output's text as it grows, it returns each piece's reasoning (the span, tags dropped) and
content (everything after the end tag, or the whole text when there is no span), holding back
only what may still be a tag; `finish` releases what it held. A whole output is split by one
`feed` and `finish` (`split_reasoning`), so a stream's pieces always add up to the unary
answer's split. Front ends apply it before anything reads the content (tool calls).

Rules, for an output whose prompt left it "undecided": a span exists when the text begins
(after whitespace) with the start tag; "thinking": the text is inside the span from its start
(a leading start tag, written again, is dropped); "answering": all content. Inside the span,
everything up to the first end tag is reasoning; a span never closed is all reasoning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster.engine.reasoning import Opening, ThinkingTags

REASONING_PARSERS: dict[str, ThinkingTags] = {
    "qwen3": ThinkingTags(always_thinks=False),
    "deepseek_r1": ThinkingTags(always_thinks=True),
}
"""`--reasoning-parser` values: Qwen3 thinks when its template lets it (`enable_thinking`),
DeepSeek-R1 always (its template opens the span, so its output may lack the start tag)."""


def reasoning_tags(parser: str | None) -> ThinkingTags | None:
    """The tags of a `--reasoning-parser` value (None: no parser); ValueError for an unknown
    one (the app's arguments allow only `REASONING_PARSERS`' names)."""
    if parser is None:
        return None
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}: {parser!r}")
    return REASONING_PARSERS[parser]


@dataclass
class SplitText:
    """A piece of output split in two ("" where it has none of one)."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplit:
    """Incremental reasoning/content split of one output (see the module doc).

    Invariant: `held` is a suffix of the text fed that may still turn out to be (part of) a tag;
    everything before it has been returned exactly once."""

    def __init__(self, tags: ThinkingTags, opening: Opening) -> None:
        self.tags = tags
        self.phase: str = {"thinking": "leading", "answering": "answering"}.get(
            opening, "undecided"
        )
        """undecided / leading (inside the span; a start tag may still come) / thinking /
        answering."""
        self.held = ""
        self.thought = opening == "thinking"
        """The output has a thinking span (so a reasoning field, maybe empty)."""

    def feed(self, text: str) -> SplitText:
        """The reasoning and content `text` completes (with what was held before it)."""
        out = SplitText()
        buffer = self.held + text
        start, end = self.tags.start, self.tags.end
        while True:
            if self.phase in ("undecided", "leading"):
                stripped = buffer.lstrip()
                if stripped.startswith(start):
                    buffer = stripped[len(start) :]
                    self.phase, self.thought = "thinking", True
                    continue
                if start.startswith(stripped):
                    break  # whitespace or a partial start tag: wait
                self.phase = "thinking" if self.phase == "leading" else "answering"
                continue
            if self.phase == "thinking":
                at = buffer.find(end)
                if at >= 0:
                    out.reasoning += buffer[:at]
                    buffer = buffer[at + len(end) :]
                    self.phase = "answering"
                    continue
                keep = _partial_suffix(buffer, end)
                out.reasoning += buffer[: len(buffer) - keep]
                buffer = buffer[len(buffer) - keep :]
                break
            out.content += buffer
            buffer = ""
            break
        self.held = buffer
        return out

    def finish(self) -> SplitText:
        """Releases what was held (a partial tag at the end is text)."""
        held, self.held = self.held, ""
        if self.phase in ("leading", "thinking"):
            return SplitText(reasoning=held)
        return SplitText(content=held)


def split_reasoning(text: str, tags: ThinkingTags, opening: Opening) -> tuple[str | None, str]:
    """A whole output's (reasoning, content): reasoning None when it has no thinking span."""
    splitter = ReasoningSplit(tags, opening)
    first, last = splitter.feed(text), splitter.finish()
    reasoning = first.reasoning + last.reasoning
    return (reasoning if splitter.thought else None), first.content + last.content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ReasoningStream:
    """The reasoning split of one streamed chat request, per branch: `start` with the prompt's
    token ids (the first delta carries them), then `piece` for each branch's new text. Without
    a parser (`tags` None) every piece is content."""

    def __init__(self, tags: ThinkingTags | None, decode: Callable[[Sequence[int]], str]) -> None:
        self.tags = tags
        self._decode = decode
        self._opening: Opening | None = None
        self._splits: dict[int, ReasoningSplit] = {}

    @property
    def active(self) -> bool:
        """A parser splits this request (it may hold text back)."""
        return self._opening is not None

    def start(self, prompt_token_ids: Sequence[int]) -> None:
        if self.tags is not None:
            self._opening = self.tags.opening_of(prompt_token_ids, self._decode)

    def piece(self, branch: int, text: str, finished: bool) -> SplitText:
        """The branch's reasoning and content that `text` completes (all of it at its finish)."""
        if self.tags is None or self._opening is None:
            return SplitText(content=text)
        split = self._splits.get(branch)
        if split is None:
            split = self._splits[branch] = ReasoningSplit(self.tags, self._opening)
        out = split.feed(text)
        if finished:
            rest = split.finish()
            out = SplitText(out.reasoning + rest.reasoning, out.content + rest.content)
        return out


def reasoning_of(
    text: str,
    tags: ThinkingTags | None,
    prompt_token_ids: Sequence[int],
    decode: Callable[[Sequence[int]], str],
) -> tuple[str | None, str]:
    """A finished output's (reasoning, content) under the parser `tags` (None: no parser, so
    (None, text)); `decode` keeps special tokens (it reads the prompt's end)."""
    if tags is None:
        return None, text
    return split_reasoning(text, tags, tags.opening_of(prompt_token_ids, decode))
