"""Tool calls read back out of a model's text, whole or while it streams.

A parser (chosen by `--tool-call-parser`, vLLM's names) splits an assistant's text into plain
content and tool calls:
- `hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text
  outside the tags is content.
- `llama3_json`: the text is one or more `{"name": ..., "parameters": {...}}` objects (separated
  by `;`, optionally after `<|python_tag|>`); text that does not start with one is content.
- `json_array` (what `tool_choice` "required" is constrained to, not a flag value): a JSON array
  of `{"name": ..., "arguments": {...}}` objects.

`scan_calls` reads a prefix of such text, so streaming can send each call's name as soon as it
is complete and then its arguments as they grow (`ToolCallDeltas`). Arguments are passed on as
the model wrote them (JSON text), as OpenAI does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class PartialCall:
    """One tool call as far as the text goes: its name once complete, its arguments' text so
    far, and whether the arguments are complete."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedText:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*')
_SCALAR = re.compile(r"[^,}\]\s]*")
_CLOSE = re.compile(r"\s*\}")


def _json_value_end(text: str, start: int) -> int | None:
    """The index after the JSON value starting at `start` (an object, array or string are
    scanned; other values end at a delimiter), or None when the text ends first."""
    depth, in_string, escaped = 0, False, False
    opening = text[start] if start < len(text) else ""
    if opening not in '{["':
        match = _SCALAR.match(text, start)
        end = match.end() if match else start
        return end if end < len(text) else None
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return index + 1
            continue
        if char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def scan_object(text: str, start: int, args_key: str) -> tuple[PartialCall, int | None]:
    """Reads `{"name": "...", "<args_key>": {...}}` from `start` (what the text holds so far);
    returns the call and the index after the object (None: not complete yet)."""
    call = PartialCall()
    match = _NAME.match(text, start)
    if match is None:
        return call, None
    name_end = _json_value_end(text, match.end())
    if name_end is None:
        return call, None
    try:
        call.name = json.loads(text[match.end() : name_end])
    except json.JSONDecodeError:
        return PartialCall(), None
    key = re.compile(r'\s*,\s*"' + re.escape(args_key) + r'"\s*:\s*').match(text, name_end)
    if key is None:
        return call, None
    args_end = _json_value_end(text, key.end())
    if args_end is None:
        call.arguments = text[key.end() :].rstrip()
        return call, None
    call.arguments, call.complete = text[key.end() : args_end], True
    close = _CLOSE.match(text, args_end)
    return call, None if close is None else close.end()


def scan_calls(text: str, start: int, args_key: str, separator: str) -> list[PartialCall]:
    """Consecutive call objects from `start`, separated by `separator` characters/whitespace."""
    calls: list[PartialCall] = []
    position: int | None = start
    while position is not None:
        call, end = scan_object(text, position, args_key)
        if call.name is None:
            break
        calls.append(call)
        if end is None:
            break
        rest = re.compile(r"[\s" + re.escape(separator) + r"]*").match(text, end)
        position = rest.end() if rest is not None and rest.end() < len(text) else None
    return calls


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedText: ...


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks; the rest is content."""

    def parse(self, text: str) -> ParsedText:
        content: list[str] = []
        calls: list[PartialCall] = []
        position = 0
        while True:
            opened = text.find(HERMES_OPEN, position)
            if opened < 0:
                tail = text[position:]
                held = _held_prefix(tail, HERMES_OPEN)
                content.append(tail[: len(tail) - held])
                break
            content.append(text[position:opened])
            inner_start = opened + len(HERMES_OPEN)
            closed = text.find(HERMES_CLOSE, inner_start)
            inner = text[inner_start:] if closed < 0 else text[inner_start:closed]
            calls.extend(scan_calls(inner, 0, "arguments", ""))
            if closed < 0:
                break
            position = closed + len(HERMES_CLOSE)
        return ParsedText("".join(content).strip() if calls else "".join(content), calls)


class Llama3JsonParser:
    """`{"name": ..., "parameters": {...}}` objects (`;`-separated) as the whole text."""

    def parse(self, text: str) -> ParsedText:
        body = text.removeprefix(PYTHON_TAG)
        stripped = body.lstrip()
        if not stripped:
            return ParsedText("")
        if stripped.startswith("{"):
            calls = scan_calls(body, 0, "parameters", ";")
            if calls:
                return ParsedText("", calls)
            compact = re.sub(r"\s", "", stripped)
            if '{"name":'.startswith(compact[:8]) and len(compact) < 8:
                return ParsedText("")  # may still become a call
        return ParsedText(text)


class JsonArrayParser:
    """A JSON array of `{"name", "arguments"}` objects (the "required" constraint's form)."""

    def parse(self, text: str) -> ParsedText:
        opened = text.find("[")
        if opened < 0:
            return ParsedText("")
        return ParsedText("", scan_calls(text, opened + 1, "arguments", ","))


TOOL_PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}
"""`--tool-call-parser` values."""


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back while streaming)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


@dataclass
class CallDelta:
    index: int
    name: str | None
    arguments: str


class ToolCallDeltas:
    """What to stream as text grows: new content, each call's name once (first), then its
    arguments' new characters. Feed the whole text so far each time."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content_sent = 0
        self.named: set[int] = set()
        self.arguments_sent: dict[int, int] = {}

    def update(self, text: str, finished: bool) -> tuple[str, list[CallDelta]]:
        parsed = self.parser.parse(text)
        content = ""
        if not parsed.calls:  # what may still start a call is held back until the end
            shown = text if finished else parsed.content
            content = shown[self.content_sent :]
            self.content_sent = max(self.content_sent, len(shown))
        deltas: list[CallDelta] = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                continue
            name = None
            if index not in self.named:
                self.named.add(index)
                name = call.name
            arguments = call.arguments
            if not call.complete and not finished:
                arguments = arguments.rstrip()  # trailing whitespace may yet be cut
            sent = self.arguments_sent.get(index, 0)
            if name is not None or len(arguments) > sent:
                deltas.append(CallDelta(index, name, arguments[sent:]))
                self.arguments_sent[index] = max(sent, len(arguments))
        return content, deltas
