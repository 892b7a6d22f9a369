"""Incremental detokenization with correct UTF-8 and stop strings that may span tokens.

Invariants:
- The text of a branch is always `decode(output_token_ids)` (up to a stop string), never a sum of
  per-token decodes: a character split over several byte-level tokens appears once, whole, when its
  last byte arrives; until then nothing is emitted for it (no U+FFFD in a stream).
- Streaming never shows text it may later take back: while a branch runs, the tail of its text
  that could be the beginning of a stop string is held back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded with the output so word-boundary spacing (e.g. sentencepiece's leading
space) comes out as it does in a full decode."""


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class TokenDecoder:
    """A decoder's `decode` with `skip_special_tokens` bound, and the text of single tokens
    remembered: the detokenizer's prefix window is usually the one token emitted last, so one
    of its two decodes per token is a lookup. Shared by every branch decoding with the same
    decoder and flag (the engine's `PromptRenderer.token_decoder` keeps one per flag); holds at
    most one entry per token id of the vocabulary."""

    __slots__ = ("decode", "single")

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.single: dict[int, str] = {}

    @classmethod
    def over(cls, decoder: Decoder, skip_special_tokens: bool) -> TokenDecoder:
        """A new, unshared one over any `decoder.decode` (a tokenizer)."""
        return cls(partial(decoder.decode, skip_special_tokens=skip_special_tokens))


class IncrementalDetokenizer:
    """Turns one branch's generated tokens into text, a token (or several) at a time."""

    def __init__(self, token_decoder: TokenDecoder, prompt_token_ids: Sequence[int]) -> None:
        self._decode = token_decoder.decode
        self._single_texts = token_decoder.single
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """New complete text produced by these tokens ("" while a character is incomplete)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def add_token(self, token_id: int) -> str:
        """`add_tokens([token_id])`, the decode step's case, without the list."""
        ids = self._ids
        ids.append(token_id)
        prefix, read = self._prefix_offset, self._read_offset
        decode = self._decode
        if read - prefix == 1:
            single = self._single_texts
            prefix_token = ids[prefix]
            prefix_text = single.get(prefix_token)
            if prefix_text is None:
                prefix_text = single[prefix_token] = decode([prefix_token])
        else:
            prefix_text = decode(ids[prefix:read])
        full_text = decode(ids[prefix:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = read
        self._read_offset = len(ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) and not final:
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text


@dataclass
class StopMatch:
    """Where a stop string ended the text: the text keeps `text[:end]`."""

    stop: str
    end: int


class TextTracker:
    """The text of one branch, its stop-string handling and what was already streamed.

    Without stop strings nothing reads the text while tokens arrive, so their pieces are kept
    as they come and joined when `text` is read (appending each to one growing string would
    copy it whole once per token). Stop strings are looked for only once more than
    `min_tokens` tokens are in, and only in the text that came after that (as vLLM does)."""

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        stop: Sequence[str],
        *,
        include_stop_str_in_output: bool,
        min_tokens: int = 0,
    ) -> None:
        self._detokenizer = detokenizer
        self._stop = tuple(stop)
        self._min_tokens = min_tokens
        self._tokens = 0
        self._stop_floor = 0
        """Stop strings are searched for from this character on (the text before it came while
        `min_tokens` held them off)."""
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._text = ""
        self._pieces: list[str] = []
        """Text after `_text`, not joined to it yet."""
        self.emitted_chars = 0

    @property
    def text(self) -> str:
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces.clear()
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._pieces.clear()
        self._text = value

    def add_tokens(self, token_ids: Sequence[int]) -> StopMatch | None:
        """Extend the text; on a stop string the text is cut there and the match returned."""
        self._tokens += len(token_ids)
        return self._extend(self._detokenizer.add_tokens(token_ids))

    def add_token(self, token_id: int) -> StopMatch | None:
        """`add_tokens([token_id])` (one decode step's token)."""
        self._tokens += 1
        new_text = self._detokenizer.add_token(token_id)
        if not new_text:
            return None
        if not self._stop:  # nothing to search for: the text only grows
            self._pieces.append(new_text)
            return None
        return self._extend(new_text)

    def finish(self) -> StopMatch | None:
        """Decode what is held back (the branch ended for another reason)."""
        return self._extend(self._detokenizer.flush())

    def _extend(self, new_text: str) -> StopMatch | None:
        if not new_text:
            return None
        if self._tokens <= self._min_tokens:
            self.text += new_text
            self._stop_floor = len(self.text)
            return None
        search_from = max(self._stop_floor, len(self.text) - self._max_stop_len + 1)
        self.text += new_text
        match = self._find_stop(search_from)
        if match is not None:
            self.text = self.text[: match.end]
        return match

    def _find_stop(self, search_from: int) -> StopMatch | None:
        best: StopMatch | None = None
        best_start = len(self.text) + 1
        for stop in self._stop:
            start = self.text.find(stop, search_from)
            if 0 <= start < best_start:
                best_start = start
                end = start + len(stop) if self._include_stop else start
                best = StopMatch(stop=stop, end=end)
        return best

    def take_delta(self, *, finished: bool) -> str:
        """Text not streamed yet; while running, a tail that may start a stop string waits."""
        visible = len(self.text) if finished else len(self.text) - self._held_back_chars()
        if visible <= self.emitted_chars:
            return ""
        delta = self.text[self.emitted_chars : visible]
        self.emitted_chars = visible
        return delta

    @property
    def streamed_text(self) -> str:
        return self.text[: self.emitted_chars]

    def _held_back_chars(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(self.text) - self._stop_floor), longest, -1):
                if self.text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
