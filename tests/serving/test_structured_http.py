"""Structured outputs over HTTP, driven by the official `openai` client against the Serve app
(tiny model): `response_format` (json_object, json_schema with strict, the client's `parse`
with a pydantic model), vLLM's `structured_outputs` extra field on both endpoints, and 400s
naming the field for constraints that cannot compile. Outputs are checked with `jsonschema`
and `re`, independent of the grammar backend."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.serving.conftest import MODEL, Served

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "color"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe the sky as JSON."}]


class Sky(BaseModel):
    clear: bool
    color: Literal["blue", "grey"]


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http_base}/v1", api_key="key-alice", max_retries=0)


def test_json_schema_chat_validates(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        seed=3,
        max_tokens=60,
        n=2,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "sky", "schema": SCHEMA, "strict": True},
        },
        extra_body={},
    )
    stopped = [c for c in response.choices if c.finish_reason == "stop"]
    assert stopped, [c.message.content for c in response.choices]
    for choice in stopped:
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, seed=1, max_tokens=60, response_format=Sky
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Sky)


def test_json_object_and_vllm_field_on_both_endpoints(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        seed=2,
        max_tokens=60,
        response_format={"type": "json_object"},
        extra_body={},
    )
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    regex = r"[0-9]{3}-[a-z]{2}"
    completion = client.completions.create(
        model=MODEL,
        prompt="Code:",
        seed=4,
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert completion.choices[0].finish_reason == "stop"
    assert re.fullmatch(regex, completion.choices[0].text)
    choice = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["sunny", "cloudy"]}},
    )
    assert choice.choices[0].message.content in {"sunny", "cloudy"}
    completion = client.completions.create(
        model=MODEL,
        prompt="JSON:",
        seed=5,
        max_tokens=60,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA},
            }
        },
    )
    if completion.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


def test_streamed_constrained_chat_is_the_same_text(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "seed": 6,
        "max_tokens": 40,
        "extra_body": {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    }
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        if chunk.choices
    )
    assert streamed == whole
    jsonschema.validate(json.loads(whole or ""), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a" * 70_000}}, "structured_outputs.regex"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    for call in (
        lambda: client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra
        ),
        lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=extra),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.status_code == 400
        body = caught.value.body
        assert isinstance(body, dict) and body.get("param") == param, body
