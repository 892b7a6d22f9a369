"""Tool calls read out of a model's text as it grows, in one pass.

A parser (chosen by `--tool-call-parser`, vLLM's names, or by the served model's chat template)
splits an assistant's text into plain content and tool calls:
- `hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text
  outside the tags is content.
- `llama3_json`: the text is one or more `{"name": ..., "parameters": {...}}` objects (separated
  by `;`, optionally after `<|python_tag|>`); text that does not start with one is content.

`CallArrayParser` reads the JSON array of calls (`[{"name": ..., "arguments": {...}}, ...]`)
that `required` with parallel calls is held to, whatever the parser.

A parser is fed the text piece by piece (`feed`, then `finish` once) and reads each character
once, so a streamed answer costs time linear in its length. What it returns is what to send:
new content, then for each call its name once (as soon as the name and the arguments' key are
read) and then its arguments' new characters, as the model wrote them (JSON text, as OpenAI
sends them). A whole text is read the same way (fed at once), so streamed and whole answers
agree by construction. Whitespace-only content is held until more content follows, and dropped
at the end when the text called a tool.

Each parser also names how its format writes one call (`CallFormat`), which is what a
constrained choice (`required`, a named function) makes the model write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_WHITESPACE = " \t\r\n"


@dataclass
class CallDelta:
    """What is new about call `index`: its name (first time only) and arguments' new text."""

    index: int
    name: str | None
    arguments: str


@dataclass
class ParsedDelta:
    """What a piece of text added: content to show and call deltas (one per call at most)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add_call(self, index: int, name: str | None = None, arguments: str = "") -> None:
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == index:
            last.name = last.name if name is None else name
            last.arguments += arguments
        else:
            self.calls.append(CallDelta(index, name, arguments))


@dataclass
class ParsedCall:
    """A call as far as the text went: its name, arguments' text, and whether the arguments
    (a whole JSON value) are complete."""

    name: str
    arguments: str
    complete: bool


@dataclass(frozen=True)
class CallFormat:
    """How a template writes calls: `begin(name)` + arguments (a JSON value) + `end`, several
    joined by `separator`."""

    prefix: str
    args_key: str
    end: str
    separator: str

    def begin(self, name: str) -> str:
        return f'{self.prefix}{{"name": {json.dumps(name)}, "{self.args_key}": '


class ToolCallParser(Protocol):
    """One answer's reader: `feed` each new piece of text, then `finish` once."""

    calls: list[ParsedCall]

    def feed(self, text: str) -> ParsedDelta: ...
    def finish(self) -> ParsedDelta: ...


class _ValueScanner:
    """Where one JSON value ends, read piece by piece: an object, array or string ends with its
    closing character; any other value at the first `,`, `}`, `]` or whitespace (not its own)."""

    def __init__(self) -> None:
        self.kind = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str, start: int) -> int | None:
        """The index just after the value in `text` (None: it goes on past `text`)."""
        for index in range(start, len(text)):
            char = text[index]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.kind == "string":
                        return index + 1
            elif not self.kind:
                if char in "{[":
                    self.kind, self.depth = "nested", 1
                elif char == '"':
                    self.kind, self.in_string = "string", True
                else:
                    self.kind = "scalar"
                    if char in ",}]" or char in _WHITESPACE:
                        return index
            elif self.kind == "scalar":
                if char in ",}]" or char in _WHITESPACE:
                    return index
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return index + 1
        return None


_SPACE, _STRING = " ", '"'


class CallReader:
    """One `{"name": "...", "<args_key>": <value>}` object, read piece by piece. `state`:
    "header" (before the arguments), "arguments", "close" (before `}`), "done" or "failed"
    (the text is not such an object)."""

    def __init__(self, args_key: str) -> None:
        self.state = "header"
        self.name: str | None = None
        self.arguments: list[str] = []
        self.closed = False
        self._steps = [_SPACE, "{", _SPACE, '"name"', _SPACE, ":", _SPACE, _STRING, _SPACE]
        self._steps += [",", _SPACE, f'"{args_key}"', _SPACE, ":", _SPACE]
        self._step = 0
        self._matched = 0
        self._raw_name: list[str] = []
        self._escaped = False
        self._value = _ValueScanner()

    @property
    def is_call(self) -> bool:
        """The name and the arguments' key are read: this is a call."""
        return self.state in ("arguments", "close", "done")

    def read(self, text: str, start: int, out: ParsedDelta, index: int) -> int:
        """Reads from `start`; adds the name and argument text to `out` as call `index`;
        returns where it stopped (`len(text)` when it needs more)."""
        position = start
        if self.state == "header":
            position = self._header(text, position)
            if self.state != "arguments":
                return position
            out.add_call(index, name=self.name)
        if self.state == "arguments":
            end = self._value.scan(text, position)
            piece = text[position : len(text) if end is None else end]
            if piece:
                self.arguments.append(piece)
                out.add_call(index, arguments=piece)
            if end is None:
                return len(text)
            self.state, position = "close", end
        while self.state == "close" and position < len(text):
            char = text[position]
            if char in _WHITESPACE:
                position += 1
            else:
                self.state, self.closed = "done", char == "}"
                return position + 1 if self.closed else position
        return position

    def _header(self, text: str, position: int) -> int:
        steps = self._steps
        while position < len(text):
            char = text[position]
            step = steps[self._step]
            if step == _SPACE:
                if char in _WHITESPACE:
                    position += 1
                    continue
                self._step += 1
            elif step == _STRING:
                position += 1
                if self._matched == 0:
                    if char != '"':
                        self.state = "failed"
                        return position - 1
                    self._matched = 1
                elif self._escaped:
                    self._escaped = False
                    self._raw_name.append(char)
                elif char == "\\":
                    self._escaped = True
                    self._raw_name.append(char)
                elif char == '"':
                    try:
                        self.name = json.loads('"' + "".join(self._raw_name) + '"')
                    except json.JSONDecodeError:
                        self.state = "failed"
                        return position
                    self._step, self._matched = self._step + 1, 0
                else:
                    self._raw_name.append(char)
                continue
            elif char == step[self._matched]:
                position += 1
                self._matched += 1
                if self._matched == len(step):
                    self._step, self._matched = self._step + 1, 0
                continue
            else:
                self.state = "failed"
                return position
            if self._step == len(steps):
                self.state = "arguments"
                return position
        return position


class _Calls:
    """The calls a parser has read, and the reader of the current one."""

    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self.readers: list[CallReader] = []

    def settle(self) -> None:
        self.calls = [
            ParsedCall(r.name or "", "".join(r.arguments), r.state in ("close", "done"))
            for r in self.readers
            if r.is_call
        ]

    @property
    def called(self) -> bool:
        return any(r.is_call for r in self.readers)


class _Content:
    """Content to send, whitespace held until something else follows it."""

    def __init__(self) -> None:
        self.held = ""

    def add(self, text: str, out: ParsedDelta) -> None:
        if not text:
            return
        if text.strip(_WHITESPACE):
            body = text.rstrip(_WHITESPACE)
            out.content += self.held + body
            self.held = text[len(body) :]
        else:
            self.held += text

    def flush(self, out: ParsedDelta, called: bool) -> None:
        if not called:
            out.content += self.held
        self.held = ""


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back until more comes)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class _ReadsCalls:
    """What every parser shares: the calls it has read (`_found`)."""

    _found: _Calls

    @property
    def calls(self) -> list[ParsedCall]:
        self._found.settle()
        return self._found.calls


class _WholeTextCalls(_ReadsCalls):
    """A parser whose text is calls from its start (else all content): `_seen` holds the text
    while it may still turn out to be content."""

    def __init__(self) -> None:
        self._found = _Calls()
        self._state = "start"
        self._seen = ""


class HermesParser(_ReadsCalls):
    """`<tool_call>{json}</tool_call>` blocks; the rest is content. A block that does not hold
    a call object is dropped."""

    FORMAT = CallFormat(f"{HERMES_OPEN}\n", "arguments", f"}}\n{HERMES_CLOSE}", "\n")

    def __init__(self) -> None:
        self._found = _Calls()
        self._content = _Content()
        self._state = "content"  # content | call | skip (to the close tag)
        self._pending = ""  # a possible tag's start

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        text, self._pending = self._pending + text, ""
        position = 0
        while position < len(text):
            if self._state == "content":
                opened = text.find(HERMES_OPEN, position)
                if opened < 0:
                    held = _held_prefix(text[position:], HERMES_OPEN)
                    self._content.add(text[position : len(text) - held], out)
                    self._pending = text[len(text) - held :]
                    break
                self._content.add(text[position:opened], out)
                position = opened + len(HERMES_OPEN)
                self._state = "call"
                self._found.readers.append(CallReader("arguments"))
            elif self._state == "call":
                reader = self._found.readers[-1]
                position = reader.read(text, position, out, len(self._found.readers) - 1)
                if reader.state == "failed":
                    self._found.readers.pop()
                if reader.state in ("done", "failed"):
                    self._state = "skip"
            else:
                closed = text.find(HERMES_CLOSE, position)
                if closed < 0:
                    held = _held_prefix(text[position:], HERMES_CLOSE)
                    self._pending = text[len(text) - held :]
                    break
                position, self._state = closed + len(HERMES_CLOSE), "content"
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "content":
            self._content.add(self._pending, out)
        self._pending = ""
        self._content.flush(out, called=self._found.called)
        return out


class Llama3JsonParser(_WholeTextCalls):
    """`{"name": ..., "parameters": {...}}` objects (`;`-separated) as the whole text; a text
    that does not start with one is all content. Text after the calls is dropped."""

    FORMAT = CallFormat("", "parameters", "}", "; ")
    # states: start | content | call | between | tail

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "content":
            out.content = text
            return out
        position = 0
        if self._state == "start" or not self._found.called:
            self._seen += text
        if self._state == "start":
            body = self._seen
            if PYTHON_TAG.startswith(body):
                return out
            body = body.removeprefix(PYTHON_TAG)
            start = len(body) - len(body.lstrip(_WHITESPACE))
            if start == len(body):
                return out
            if body[start] != "{":
                return self._as_content(out)
            text, position = body, start
            self._state = "call"
            self._found.readers.append(CallReader("parameters"))
        while position < len(text) and self._state not in ("tail", "content"):
            if self._state == "call":
                reader = self._found.readers[-1]
                position = reader.read(text, position, out, len(self._found.readers) - 1)
                if reader.state == "failed":
                    if len(self._found.readers) == 1:
                        return self._as_content(out)
                    self._found.readers.pop()
                    self._state = "tail"
                elif reader.state == "done":
                    self._state = "between" if reader.closed else "tail"
            elif text[position] in _WHITESPACE or text[position] == ";":
                position += 1
            elif text[position] == "{":
                self._state = "call"
                self._found.readers.append(CallReader("parameters"))
            else:
                self._state = "tail"
        if self._found.called:
            self._seen = ""
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if not self._found.called and self._state != "content":
            out.content, self._state = self._seen, "content"
            self._found.readers.clear()
        self._seen = ""
        return out

    def _as_content(self, out: ParsedDelta) -> ParsedDelta:
        out.content, self._seen, self._state = self._seen, "", "content"
        self._found.readers.clear()
        return out


class CallArrayParser(_WholeTextCalls):
    """A JSON array of `{"name": ..., "arguments": {...}}` objects as the whole text (what
    `required` with parallel calls makes the model write). A text that does not start with `[`
    is all content; text after the array's calls (its `]` or anything that is not one more call)
    is dropped."""

    # states: start | open (a call may follow) | call | between | tail | content; `_seen` holds
    # only the leading whitespace

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "content":
            out.content = text
            return out
        position = 0
        if self._state == "start":
            while position < len(text) and text[position] in _WHITESPACE:
                position += 1
            self._seen += text[:position]
            if position == len(text):
                return out
            if text[position] != "[":
                out.content, self._seen, self._state = self._seen + text[position:], "", "content"
                return out
            position, self._seen, self._state = position + 1, "", "open"
        readers = self._found.readers
        while position < len(text) and self._state != "tail":
            if self._state == "call":
                reader = readers[-1]
                position = reader.read(text, position, out, len(readers) - 1)
                if reader.state == "failed":
                    readers.pop()
                    self._state = "tail"
                elif reader.state == "done":
                    self._state = "between" if reader.closed else "tail"
                continue
            char = text[position]
            if char in _WHITESPACE:
                position += 1
            elif char == "," and self._state == "between":
                position, self._state = position + 1, "open"
            elif char == "{" and self._state == "open":
                self._state = "call"  # the reader reads the `{` itself
                readers.append(CallReader("arguments"))
            else:
                self._state = "tail"
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "start":
            out.content, self._state = self._seen, "content"
        self._seen = ""
        return out


TOOL_PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}
"""`--tool-call-parser` values."""
