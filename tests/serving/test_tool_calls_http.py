"""Tool calling and structured outputs over HTTP with the official `openai` client against the
Serve app (tiny model, no tool flags: auto tool choice on, the parser picked from the template):
`required` and named choices always give valid calls of listed functions whose arguments
satisfy their schema (`jsonschema`), also streamed with parallel calls; a named choice cut by
`max_tokens` still answers in `tool_calls`; tools without `tool_choice` are answered; `auto`
reads Hermes blocks out of the text; streaming sends each call's name first and then its
arguments; tool messages render; `.parse` gives the pydantic object; and bad tool input is a
400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel

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
        max_tokens=120,
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
        "max_tokens": 80,
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


def test_tools_without_tool_choice_are_answered(client: openai.OpenAI) -> None:
    """OpenAI's default with tools is "auto": answered by a server started without flags."""
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=4
    )
    choice = response.choices[0]
    assert choice.message.content or choice.message.tool_calls


@pytest.mark.parametrize("max_tokens", [3, 20])
def test_a_named_choice_cut_by_max_tokens_is_still_a_call(
    client: openai.OpenAI, max_tokens: int
) -> None:
    """Cut in the call's opening (3) or in its arguments (20): the call, its arguments as
    generated, finish_reason "length"."""
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=max_tokens,
        seed=5,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is not None and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_time" and call.id
    written = "".join(call.function.arguments.split())  # free whitespace between tokens
    assert '{"zone":"UTC"}'.startswith(written) or '{"zone":"CET"}'.startswith(written)


def test_streamed_parallel_calls_are_each_valid(client: openai.OpenAI) -> None:
    arguments: dict[int, str] = {}
    names: dict[int, str] = {}
    reasons = []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        seed=6,
        max_tokens=200,
        stream=True,
    ):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                assert call.function is not None
                if call.function.name:
                    assert call.index not in names and call.id
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (
                    call.function.arguments or ""
                )
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert len(reasons) == 1 and reasons[0] in ("tool_calls", "length")
    assert names and sorted(names) == list(range(len(names)))
    complete = sorted(names) if reasons == ["tool_calls"] else sorted(names)[:-1]
    for index in complete:  # a call cut by max_tokens is a prefix
        jsonschema.validate(json.loads(arguments[index]), SCHEMAS[names[index]])


class City(BaseModel):
    name: str
    country: str
    population: int


def test_parse_gives_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a city."}],
        response_format=City,
        seed=7,
        max_tokens=400,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, City)
    assert message.parsed == City.model_validate_json(message.content or "")


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
