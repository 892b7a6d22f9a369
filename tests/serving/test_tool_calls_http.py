"""Tool calling over HTTP with the official `openai` client against the Serve app (tiny model,
`enable_auto_tool_choice` with the `hermes` parser): `required` and named choices always give
valid calls of listed functions whose arguments satisfy their schema (`jsonschema`), `auto` reads
Hermes blocks out of the text, streaming sends each call's name first and then its arguments,
tool messages render, and bad tool input is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.serving.conftest import MODEL, Served

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http_base}/v1", api_key="key-alice", max_retries=0)


def _assert_valid_calls(calls: Any, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1])
def test_required_choice_is_always_a_valid_call(client: openai.OpenAI, seed: int) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=seed,
        max_tokens=80,
        extra_body={"temperature": 1.0},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    _assert_valid_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    assert len(choice.message.tool_calls or []) == 1


def test_named_choice_calls_that_function(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        seed=2,
        max_tokens=40,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    _assert_valid_calls(choice.message.tool_calls, {"get_time"})


def test_streamed_calls_send_the_name_first_then_arguments(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "seed": 3,
        "max_tokens": 40,
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    names, arguments, reasons = [], "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function and call.function.name:
                    assert not arguments, "the name comes before any argument text"
                    names.append(call.function.name)
                if call.function and call.function.arguments:
                    arguments += call.function.arguments
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert names == ["get_weather"]
    assert reasons == ["tool_calls"] == [whole.finish_reason]
    assert whole.message.tool_calls is not None
    assert json.loads(arguments) == json.loads(whole.message.tool_calls[0].function.arguments)


def test_auto_reads_hermes_blocks_and_tool_messages_render(client: openai.OpenAI) -> None:
    """`auto` is free text read back by the hermes parser; the text is forced into a Hermes
    block here (a random model writes none) to check the parse end to end."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
    grammar = 'root ::= "' + call.replace('"', '\\"').replace("\n", "\\n") + '</tool_call>"'
    conversation: list[Any] = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    response = client.chat.completions.create(
        model=MODEL,
        messages=conversation,
        tools=TOOLS,
        max_tokens=160,  # the forced block is 50-60 tokens however the model splits it
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {
        "city": "Oslo",
        "days": 2,
    }
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert plain.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=body
        )
    assert isinstance(caught.value.body, dict) and caught.value.body.get("param") == param
