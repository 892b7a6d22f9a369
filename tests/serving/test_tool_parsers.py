"""Tool calls read back from text (hermes, llama3_json, the JSON array of calls) in one
incremental pass, against an
independent whole-text oracle (regular expressions and `json`): for any calls written with
`json.dumps`, any content around them and any split of the text into pieces (Hypothesis), the
streamed content and calls equal the oracle's; a prefix of the text gives a prefix of them
(what streaming shows before the end); and feeding a long answer a character at a time costs
linear time."""

from __future__ import annotations

import itertools
import json
import re
import time
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.serving.tool_parsers import (
    PYTHON_TAG,
    CallArrayParser,
    HermesParser,
    Llama3JsonParser,
    ToolCallParser,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
calls_strategy = st.lists(
    st.tuples(
        st.from_regex(r"[a-z_]{1,10}", fullmatch=True),
        st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    ),
    min_size=1,
    max_size=3,
)
content_strategy = st.text(alphabet="ab <>/\n{}", max_size=12)
Calls = list[tuple[str, str]]
"""(name, arguments as JSON text) per call."""


def _hermes(calls: list[tuple[str, Any]], gaps: list[str]) -> str:
    """Content gaps around `<tool_call>` blocks, arguments written by `json.dumps`."""
    blocks = [
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    ]
    return gaps[0] + "".join(block + gap for block, gap in zip(blocks, gaps[1:], strict=False))


def hermes_oracle(text: str) -> tuple[str, Calls]:
    """Content outside the blocks (its trailing whitespace dropped when there are calls) and
    each block's call, by a regular expression and `json`."""
    content, calls, position = [], [], 0
    for block in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.S):
        content.append(text[position : block.start()])
        position = block.end()
        call = json.loads(block.group(1))
        calls.append((call["name"], json.dumps(call["arguments"])))
    content.append(text[position:])
    shown = "".join(content)
    return (shown.rstrip(" \t\r\n") if calls else shown), calls


def read(parser: ToolCallParser, pieces: list[str], finish: bool = True) -> tuple[str, Calls]:
    """Feeds the pieces, then finishes (unless told not to: a stream still going); rebuilds
    content and calls from the deltas alone."""
    content: str = ""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for piece in [*pieces, None] if finish else pieces:
        delta = parser.feed(piece) if piece is not None else parser.finish()
        content += delta.content
        for call in delta.calls:
            if call.name is not None:
                assert call.index not in names, "a name is sent once, before its arguments"
                names[call.index] = call.name
            assert call.index in names
            arguments[call.index] = arguments.get(call.index, "") + call.arguments
    streamed = [(names[i], arguments.get(i, "")) for i in sorted(names)]
    assert [(c.name, c.arguments) for c in parser.calls] == streamed
    return content, streamed


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    return [text[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=150, deadline=None)
@given(
    calls=st.lists(st.tuples(st.from_regex(r"[a-z_]{1,10}", fullmatch=True), json_values)),
    gaps=st.lists(content_strategy, min_size=4, max_size=4),
    cuts=st.lists(st.integers(1, 400), max_size=16),
)
def test_hermes_pieces_read_as_the_oracle_reads_the_whole(
    calls: list[tuple[str, Any]], gaps: list[str], cuts: list[int]
) -> None:
    calls = [(n, a if isinstance(a, dict) else {"value": a}) for n, a in calls[:3]]
    text = _hermes(calls, gaps)
    expected = hermes_oracle(text)
    assert read(HermesParser(), split(text, cuts)) == expected
    assert read(HermesParser(), [text]) == expected


@settings(max_examples=100, deadline=None)
@given(
    calls=calls_strategy,
    gaps=st.lists(content_strategy, min_size=4, max_size=4),
    cut=st.integers(0, 10_000),
    pieces=st.lists(st.integers(1, 400), max_size=8),
)
def test_a_prefix_reads_as_a_prefix_of_the_whole(
    calls: list[tuple[str, Any]], gaps: list[str], cut: int, pieces: list[int]
) -> None:
    """What streaming shows before the end: the calls so far, the last one's arguments a
    prefix of what it will be, never anything the whole text does not have."""
    text = _hermes(calls, gaps)
    whole_content, whole_calls = hermes_oracle(text)
    prefix = text[: cut % (len(text) + 1)]
    content, partial = read(HermesParser(), split(prefix, pieces), finish=False)
    assert len(partial) <= len(whole_calls)
    for (name, arguments), (whole_name, whole_arguments) in zip(partial, whole_calls, strict=False):
        assert name == whole_name and whole_arguments.startswith(arguments)
    assert whole_content.startswith(content)


@settings(max_examples=100, deadline=None)
@given(calls=calls_strategy, tag=st.booleans(), cuts=st.lists(st.integers(1, 400), max_size=12))
def test_llama3_json_pieces_read_as_written(
    calls: list[tuple[str, dict[str, Any]]], tag: bool, cuts: list[int]
) -> None:
    text = (PYTHON_TAG if tag else "") + "; ".join(
        json.dumps({"name": n, "parameters": a}) for n, a in calls
    )
    written = [(n, json.dumps(a)) for n, a in calls]
    assert read(Llama3JsonParser(), split(text, cuts)) == ("", written)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet='ab {}"n:', max_size=30), cuts=st.lists(st.integers(1, 30)))
def test_llama3_text_that_is_not_a_call_is_all_content(text: str, cuts: list[int]) -> None:
    try:
        first = json.JSONDecoder().raw_decode(text.lstrip())[0]
    except json.JSONDecodeError:
        first = None
    if isinstance(first, dict) and "name" in first:
        return  # a call (the property above covers those)
    content, calls = read(Llama3JsonParser(), split(text, cuts))
    assert (content, calls) == (text, [])


def test_a_possible_tag_is_held_back_until_the_end() -> None:
    parser = HermesParser()
    assert parser.feed("Hello <tool").content == "Hello"
    assert parser.finish().content == " <tool"
    llama = Llama3JsonParser()
    assert llama.feed('{"na').content == ""
    assert llama.finish().content == '{"na'


def test_whitespace_between_calls_is_not_content() -> None:
    block = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert read(HermesParser(), [f"{block}\n", f"{block}\n"]) == ("", [("f", "{}"), ("f", "{}")])
    assert read(HermesParser(), ["no calls \n"]) == ("no calls \n", [])


def test_a_block_without_a_call_object_is_dropped() -> None:
    assert read(HermesParser(), ["a <tool_call>oops</tool_call> b"]) == ("a  b", [])


def test_one_character_at_a_time_costs_linear_time() -> None:
    """A 40 000-character answer fed a character at a time: a parser that re-read the text
    on every piece would do 800 million character steps; this one does 40 000."""
    arguments = json.dumps({"text": "x" * 40_000})
    text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    parser = HermesParser()
    began = time.perf_counter()
    for char in text:
        parser.feed(char)
    parser.finish()
    assert time.perf_counter() - began < 5.0
    assert [(c.name, c.arguments) for c in parser.calls] == [("f", arguments)]


SEPARATORS = st.sampled_from([(", ", ": "), (",", ":")])
"""`json.dumps`' default (what the grammar without free whitespace makes the model write) and
compact JSON."""


def array_oracle(text: str, separators: tuple[str, str]) -> Calls:
    """Each call of the whole array, by `json`, its arguments written back as they were."""
    return [
        (call["name"], json.dumps(call["arguments"], separators=separators))
        for call in json.loads(text)
    ]


@settings(max_examples=150, deadline=None)
@given(
    calls=calls_strategy,
    separators=SEPARATORS,
    lead=st.sampled_from(["", " ", "\n"]),
    cuts=st.lists(st.integers(1, 400), max_size=16),
)
def test_array_pieces_read_as_the_oracle_reads_the_whole(
    calls: list[tuple[str, Any]], separators: tuple[str, str], lead: str, cuts: list[int]
) -> None:
    text = json.dumps([{"name": n, "arguments": a} for n, a in calls], separators=separators)
    expected = ("", array_oracle(text, separators))
    assert read(CallArrayParser(), split(lead + text, cuts)) == expected
    assert read(CallArrayParser(), [lead + text]) == expected


@settings(max_examples=100, deadline=None)
@given(
    calls=calls_strategy,
    separators=SEPARATORS,
    cut=st.integers(0, 10_000),
    pieces=st.lists(st.integers(1, 400), max_size=8),
)
def test_an_array_prefix_reads_as_a_prefix_of_the_whole(
    calls: list[tuple[str, Any]], separators: tuple[str, str], cut: int, pieces: list[int]
) -> None:
    """A stream cut anywhere (`max_tokens`, or not yet ended): the calls so far, the last one's
    arguments a prefix of what it will be; never content."""
    text = json.dumps([{"name": n, "arguments": a} for n, a in calls], separators=separators)
    whole = array_oracle(text, separators)
    prefix = text[: cut % (len(text) + 1)]
    for finish in (False, True):
        content, partial = read(CallArrayParser(), split(prefix, pieces), finish=finish)
        assert content == "" and len(partial) <= len(whole)
        for (name, arguments), (whole_name, whole_arguments) in zip(partial, whole, strict=False):
            assert name == whole_name and whole_arguments.startswith(arguments)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet='ab {}"n:[', max_size=30), cuts=st.lists(st.integers(1, 30)))
def test_text_that_is_not_an_array_is_all_content(text: str, cuts: list[int]) -> None:
    if text.lstrip(" \t\r\n").startswith("["):
        return  # an array (the properties above cover those)
    assert read(CallArrayParser(), split(text, cuts)) == (text, [])


def test_the_array_ends_its_calls() -> None:
    """What follows the array (or a malformed element) is dropped, the calls before kept."""
    call = '{"name":"f","arguments":{}}'
    assert read(CallArrayParser(), [f"[{call},{call}] and more"]) == ("", [("f", "{}")] * 2)
    assert read(CallArrayParser(), [f"[{call}, 3]"]) == ("", [("f", "{}")])
    assert read(CallArrayParser(), ["[]"]) == ("", [])
