"""A request's tool plan: the parser the server picks from the model's template, the refusals,
the grammar a constrained choice is held to (checked by xgrammar's matcher on texts written
with `json.dumps`, read back by the parser), and the fallback chat template's rendering."""

from __future__ import annotations

import json
from typing import Any

import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from cluster.engine.structured_outputs import parse_grammar
from cluster.serving.structured_fields import FieldError
from cluster.serving.tool_calls import (
    FALLBACK_TOOL_TEMPLATE,
    NamedToolChoice,
    ToolDef,
    ToolPlan,
    ToolSettings,
    calls_of,
    parser_for_template,
    plan_tools,
    template_for,
)
from tests.tiny_model import smollm2_tokenizer

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
SERVER = ToolSettings().for_template(None)
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ tools }}"
    "{{ m['content'] }}<|eot_id|>{% endfor %}<|python_tag|>"
)


def test_the_default_parser_fits_the_template_and_a_flag_wins() -> None:
    assert parser_for_template(smollm2_tokenizer().chat_template) == "hermes"  # the fallback
    assert parser_for_template(None) == "hermes"
    assert parser_for_template("{{ tools }}<tool_call>{{ m }}</tool_call>") == "hermes"
    assert parser_for_template(LLAMA3_TEMPLATE) == "llama3_json"
    flagged = ToolSettings(tool_call_parser="hermes").for_template(LLAMA3_TEMPLATE)
    assert flagged.tool_call_parser == "hermes"
    assert ToolSettings().enable_auto_tool_choice  # on unless turned off
    with pytest.raises(ValueError, match="tool_call_parser"):
        ToolSettings(tool_call_parser="mistral")


def test_plan_refusals_name_the_field() -> None:
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}})
    with pytest.raises(FieldError) as caught:
        plan_tools(TOOLS, named, None, SERVER)
    assert caught.value.param == "tool_choice"
    off = ToolSettings(enable_auto_tool_choice=False).for_template(None)
    with pytest.raises(FieldError) as caught:
        plan_tools(TOOLS, None, None, off)  # no tool_choice is "auto"
    assert caught.value.param == "tool_choice" and "auto-tool-choice" in str(caught.value)
    bad = ToolDef.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    )
    with pytest.raises(FieldError) as caught:
        plan_tools([TOOLS[0], bad], "required", None, SERVER)
    assert caught.value.param == "tools[1].function.parameters"
    with pytest.raises(FieldError):
        plan_tools(None, "required", None, SERVER)


def _hermes_call(name: str, arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _array(*calls: tuple[str, Any]) -> str:
    """Calls as the array form writes them (no free whitespace: xgrammar's `, ` and `: `)."""
    return json.dumps([{"name": name, "arguments": arguments} for name, arguments in calls])


def _grammar(plan: ToolPlan | None) -> Grammar:
    """The grammar the engine compiles for the plan's constraint."""
    assert plan is not None
    constraint = plan.constraint()
    assert constraint is not None
    return parse_grammar(constraint.spec)


def test_required_with_parallel_calls_is_a_json_array_of_calls() -> None:
    for settings in (SERVER, ToolSettings().for_template(LLAMA3_TEMPLATE)):  # whatever parser
        plan = plan_tools(TOOLS, "required", None, settings)
        assert plan is not None and plan.array_form
        grammar = _grammar(plan)
        weather, ping = ("get_weather", {"city": "Oslo"}), ("ping", {})
        for text in (_array(weather), _array(weather, ping), _array(ping, ping, weather)):
            assert _is_grammar_accept_string(grammar, text), text
        for text in (
            "[]",
            "Sure. " + _array(weather),
            _array(("other", {})),
            _array(("get_weather", {})),
            _array(("get_weather", {"city": 3})),
            _array(weather) + " and more",
            _hermes_call(*weather),
        ):
            assert not _is_grammar_accept_string(grammar, text), text
        content, calls = calls_of(_array(weather, ping), plan)
        assert content is None
        assert [(c.function.name, json.loads(c.function.arguments or "")) for c in calls] == [
            weather,
            ping,
        ]


def test_single_and_named_choices_allow_exactly_one_call() -> None:
    weather = _hermes_call("get_weather", {"city": "Oslo"})
    single = _grammar(plan_tools(TOOLS, "required", False, SERVER))
    named = _grammar(
        plan_tools(
            TOOLS,
            NamedToolChoice.model_validate({"type": "function", "function": {"name": "ping"}}),
            None,
            SERVER,
        )
    )
    assert _is_grammar_accept_string(single, weather)
    assert not _is_grammar_accept_string(single, f"{weather}\n{weather}")
    assert _is_grammar_accept_string(named, _hermes_call("ping", {}))
    assert not _is_grammar_accept_string(named, weather)


def test_llama3_templates_are_held_to_their_own_form() -> None:
    plan = plan_tools(TOOLS, "required", False, ToolSettings().for_template(LLAMA3_TEMPLATE))
    grammar = _grammar(plan)
    one = json.dumps({"name": "get_weather", "parameters": {"city": "Oslo"}})
    assert _is_grammar_accept_string(grammar, one)
    assert not _is_grammar_accept_string(grammar, one + "; " + one)
    assert not _is_grammar_accept_string(grammar, _hermes_call("get_weather", {"city": "Oslo"}))


def test_a_cut_constrained_answer_is_still_a_call() -> None:
    """`max_tokens` cut the arguments: a named or required choice answers in `tool_calls`
    with the arguments as generated; `auto` leaves the text as content."""
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "1.1.1.1'
    named = NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_weather"}}
    )
    cut_array = '[{"name": "get_weather", "arguments": {"city": "1.1.1.1'
    for choice, text in ((named, cut), ("required", cut_array)):
        plan = plan_tools(TOOLS, choice, None, SERVER)
        assert plan is not None
        content, calls = calls_of(text, plan)
        assert content is None and calls[0].function.name == "get_weather"
        assert calls[0].function.arguments == '{"city": "1.1.1.1'
    auto = plan_tools(TOOLS, "auto", None, SERVER)
    assert auto is not None
    assert calls_of(cut, auto) == (cut, [])
    plan = plan_tools(TOOLS, named, None, SERVER)
    assert plan is not None
    for cut_early in ('<tool_call>\n{"na', "<tool"):  # cut before the name: still that call
        content, calls = calls_of(cut_early, plan)
        assert content is None
        assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", "")]
    stream = plan.stream()
    assert stream is not None
    _, streamed = stream.update(0, '<tool_call>\n{"na', finished=True)
    assert streamed is not None and streamed[0].function.name == "get_weather"
    assert stream.called(0)


@pytest.mark.parametrize("parallel", [True, False])
def test_a_stream_sends_what_the_whole_answer_holds(parallel: bool) -> None:
    """The stream and the whole answer read the text with one reader: the array's with
    parallel calls, the parser's call form without."""
    weather = ("get_weather", {"city": "Oslo"})
    text = _array(weather, ("ping", {})) if parallel else _hermes_call(*weather)
    plan = plan_tools(TOOLS, "required", parallel, SERVER)
    assert plan is not None
    stream = plan.stream()
    assert stream is not None
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for start in range(0, len(text), 7):
        end = min(start + 7, len(text))
        content, calls = stream.update(0, text[start:end], finished=end == len(text))
        assert content is None
        for call in calls or []:
            assert call.index is not None
            if call.function.name is not None:
                assert call.id and call.type == "function"
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    _, whole = calls_of(text, plan)
    assert [(names[i], arguments[i]) for i in sorted(names)] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert len(whole) == (2 if parallel else 1)


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
    call = _hermes_call("get_weather", {"city": "Oslo"})
    assert call in text  # what the template teaches is what `required` is held to
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
