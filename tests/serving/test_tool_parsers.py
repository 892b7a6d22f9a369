"""Tool calls read back from text (hermes, llama3_json, the required choice's JSON array) and
streamed as deltas: for any calls written with `json.dumps` and any chunking of the text, the
streamed names and argument fragments rebuild exactly the calls written (Hypothesis). Plus the
tool plan's refusals and grammar, and the fallback chat template's rendering."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.serving.structured_fields import FieldError
from cluster.serving.tool_calls import (
    FALLBACK_TOOL_TEMPLATE,
    NamedToolChoice,
    ToolDef,
    ToolSettings,
    plan_tools,
    template_for,
)
from cluster.serving.tool_parsers import (
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
    ToolCallDeltas,
    ToolParser,
)
from tests.tiny_model import smollm2_tokenizer

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


def _write(form: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    if form == "hermes":
        return "Let me check. " + "\n".join(
            f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
            for n, a in calls
        )
    if form == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return json.dumps([{"name": n, "arguments": a} for n, a in calls])


PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser] | type[JsonArrayParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "array": JsonArrayParser,
}


@pytest.mark.parametrize("form", sorted(PARSERS))
@settings(max_examples=60, deadline=None)
@given(calls=calls_strategy, cuts=st.lists(st.integers(1, 400), max_size=12))
def test_streamed_deltas_rebuild_the_calls(
    form: str, calls: list[tuple[str, dict[str, Any]]], cuts: list[int]
) -> None:
    text = _write(form, calls)
    parser: ToolParser = PARSERS[form]()
    whole = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    deltas = ToolCallDeltas(PARSERS[form]())
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for end in [*sorted(c for c in cuts if c < len(text)), len(text)]:
        _, sent = deltas.update(text[:end], end == len(text))
        for delta in sent:
            if delta.name is not None:
                assert delta.index not in names and not arguments.get(delta.index)
                names[delta.index] = delta.name
            arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == calls


def test_streamed_text_holds_back_a_possible_tag_until_the_end() -> None:
    deltas = ToolCallDeltas(HermesParser())
    assert deltas.update("Hello <tool", finished=False) == ("Hello ", [])
    assert deltas.update("Hello <tool", finished=True) == ("<tool", [])
    llama = ToolCallDeltas(Llama3JsonParser())
    assert llama.update('{"na', finished=False) == ("", [])
    assert llama.update('{"na', finished=True) == ('{"na', [])


def test_plain_text_is_content() -> None:
    assert HermesParser().parse("no calls here").content == "no calls here"
    assert not HermesParser().parse("no calls here").calls
    assert Llama3JsonParser().parse("Hello there").content == "Hello there"


TOOLS = [
    ToolDef.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ),
    ToolDef.model_validate({"type": "function", "function": {"name": "ping"}}),
]
AUTO = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


def test_plan_refusals_name_the_field() -> None:
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}})
    with pytest.raises(FieldError) as caught:
        plan_tools(TOOLS, named, None, AUTO)
    assert caught.value.param == "tool_choice"
    with pytest.raises(FieldError) as caught:
        plan_tools(TOOLS, "auto", None, ToolSettings())
    assert caught.value.param == "tool_choice" and "--enable-auto-tool-choice" in str(caught.value)
    bad = ToolDef.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    )
    with pytest.raises(FieldError) as caught:
        plan_tools([TOOLS[0], bad], "required", None, AUTO)
    assert caught.value.param == "tools[1].function.parameters"
    with pytest.raises(FieldError):
        plan_tools(None, "required", None, AUTO)


def test_required_grammar_is_an_array_of_listed_calls() -> None:
    plan = plan_tools(TOOLS, "required", False, AUTO)
    assert plan is not None
    constraint = plan.constraint()
    assert constraint is not None and isinstance(constraint.json, dict)
    schema = constraint.json
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    for bad in (
        [],
        [{"name": "other", "arguments": {}}],
        [{"name": "get_weather", "arguments": {}}],
        [{"name": "ping", "arguments": {}}, {"name": "ping", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_fallback_template_renders_tools_calls_and_results() -> None:
    tokenizer = smollm2_tokenizer()
    assert template_for(tokenizer.chat_template) == FALLBACK_TOOL_TEMPLATE  # it has no tools
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=FALLBACK_TOOL_TEMPLATE,
        tools=[t.model_dump(exclude_none=True) for t in TOOLS],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call")
    assert '"name": "get_weather"' in text and "<tools>" in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert call in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    parsed = HermesParser().parse(text[text.index("<tool_call>") :])
    assert parsed.calls[0].name == "get_weather"
