"""OpenAI's Responses API, Anthropic's Messages API and vLLM's tokenizer routes over the shared
Serve app (tiny model, API keys, `hermes` auto tool choice), driven with the official `openai`
and `anthropic` clients: what a user reads back (texts, parsed objects, calls, event order,
stored responses, errors), checked against the chat route on the same prompt, HF's tokenizer
and JSON schemas; closing a stream mid-way aborts its request and frees its blocks."""

from __future__ import annotations

import json
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.serving.conftest import MODEL, GreedyOracle, Served

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ALICE = "key-alice"
GREEDY = {"temperature": 0}
"""Anthropic's client takes sampling fields only through `extra_body`."""


class City(pydantic.BaseModel):
    city: Literal["Paris", "Oslo"]


@pytest.fixture
def oai(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http_base}/v1", api_key=ALICE, max_retries=0)


@pytest.fixture
def claude(served: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.http_base, api_key=ALICE, max_retries=0)


def tokenize(served: Served, **body: Any) -> list[int]:
    answer = httpx.post(f"{served.http_base}/tokenize", json=body, timeout=30).json()
    assert answer["count"] == len(answer["tokens"])
    return list(answer["tokens"])


def test_responses_text_is_the_chat_answer_and_the_store_continues_it(
    served: Served, oai: openai.OpenAI
) -> None:
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=12,
        temperature=0,
    )
    first = oai.responses.create(
        model=MODEL, instructions="Be brief.", input="Hi", max_output_tokens=12, temperature=0
    )
    assert first.output_text == chat.choices[0].message.content
    assert first.usage is not None and chat.usage is not None
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    assert first.usage.output_tokens == chat.usage.completion_tokens
    assert first.usage.input_tokens_details.cached_tokens > 0  # the chat call's blocks
    assert first.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )

    follow = oai.responses.create(
        model=MODEL, input="And?", previous_response_id=first.id, max_output_tokens=4
    )
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And?"},
    ]  # `instructions` are not carried over
    assert follow.usage is not None
    assert follow.usage.input_tokens == len(tokenize(served, model=MODEL, messages=conversation))

    assert oai.responses.retrieve(first.id).output_text == first.output_text
    bob = openai.OpenAI(base_url=f"{served.http_base}/v1", api_key="key-bob", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(first.id)  # another tenant's response
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as refused:
        oai.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_responses_stream_function_calls_then_takes_their_output(oai: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    with oai.responses.stream(
        model=MODEL,
        input="Weather in Paris?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments

    answer = oai.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=tools,
        tool_choice="none",
        max_output_tokens=4,
    )  # fmt: skip
    assert [item.type for item in answer.output] == ["message"] and answer.output_text


def test_responses_parse_gives_the_pydantic_object(oai: openai.OpenAI) -> None:
    parsed = oai.responses.parse(
        model=MODEL, input="Which city?", text_format=City, max_output_tokens=60, temperature=0
    )
    assert isinstance(parsed.output_parsed, City)


def test_responses_refusals_are_openai_400s_naming_the_field(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai.responses.create(
            model=MODEL,
            input="x",
            tools=[{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}],  # type: ignore[list-item]
            tool_choice="required",
        )
    assert refused.value.body["param"] == "tools[0].parameters"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="nope", input="x")


def test_messages_text_stop_sequence_and_token_count(
    claude: anthropic.Anthropic, oai: openai.OpenAI
) -> None:
    messages: Any = [{"role": "user", "content": "Hello"}]
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, *messages],
        max_tokens=10,
        temperature=0,
    )
    message = claude.messages.create(
        model=MODEL, system="Be brief.", messages=messages, max_tokens=10, extra_body=GREEDY
    )
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.stop_reason == (
        "max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn"
    )
    usage = message.usage
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert chat.usage is not None and counted.input_tokens == chat.usage.prompt_tokens

    stop = block.text.split()[1]  # a word from the middle of the greedy answer
    stopped = claude.messages.create(
        model=MODEL, system="Be brief.", messages=messages, max_tokens=10, extra_body=GREEDY,
        stop_sequences=[stop],
    )  # fmt: skip
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == block.text[: block.text.index(stop)]  # type: ignore[union-attr]


def test_messages_stream_tool_use_then_a_tool_result(claude: anthropic.Anthropic) -> None:
    tools: Any = [{"name": "get_weather", "description": "Weather", "input_schema": CITY}]
    with claude.messages.stream(
        model=MODEL,
        max_tokens=200,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    (call,) = final.content
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, CITY)
    assert final.stop_reason == "tool_use"

    use = call.model_dump(include={"type", "id", "name", "input"})
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "rain"}
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]},
        ],
        tools=tools,
        tool_choice={"type": "none"},
    )
    assert answer.content[0].type == "text"


def test_messages_errors_have_anthropics_shape(served: Served) -> None:
    url = f"{served.http_base}/v1/messages"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    missing = httpx.post(url, json=body, headers={"x-api-key": ALICE}, timeout=30)
    assert missing.status_code == 400
    assert missing.json()["type"] == "error"
    assert missing.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(
            base_url=served.http_base, api_key="nope", max_retries=0
        ).messages.create(
            model=MODEL,
            max_tokens=2,
            messages=body["messages"],  # type: ignore[arg-type]
        )
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    bearer = anthropic.Anthropic(base_url=served.http_base, auth_token=ALICE, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        bearer.messages.create(model="nope", max_tokens=2, messages=body["messages"])  # type: ignore[arg-type]


def test_tokenizer_routes_are_the_served_tokenizer(served: Served, oracle: GreedyOracle) -> None:
    text = "Paged attention keeps KV blocks."
    ids = tokenize(served, prompt=text, add_special_tokens=False)
    assert ids == oracle.tokenizer.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": text}]
    assert tokenize(served, model=MODEL, messages=messages) == oracle.prompt_ids(messages)
    detokenized = httpx.post(f"{served.http_base}/detokenize", json={"tokens": ids}, timeout=30)
    assert detokenized.json() == {"prompt": oracle.tokenizer.decode(ids)}
    info = httpx.get(f"{served.http_base}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == oracle.tokenizer.eos_token  # what lm-eval's probe reads
    assert info["chat_template"] == oracle.tokenizer.chat_template
    bad = httpx.post(f"{served.http_base}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[0]"


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_closing_a_stream_aborts_its_request(
    served: Served, oai: openai.OpenAI, claude: anthropic.Anthropic, api: str
) -> None:
    before = served.wait_until_idle()
    prompt = "Tell me a long story."
    if api == "responses":
        manager: Any = oai.responses.stream(
            model=MODEL, input=prompt, max_output_tokens=400, temperature=0
        )
        delta = "response.output_text.delta"
    else:
        manager = claude.messages.stream(
            model=MODEL, max_tokens=400, messages=[{"role": "user", "content": prompt}],
            extra_body=GREEDY,
        )  # fmt: skip
        delta = "content_block_delta"
    with manager as stream:
        seen = 0
        for event in stream:
            seen += event.type == delta
            if seen == 3:
                assert served.metrics()["pagedserve_sequences{queue=running}"] == 1
                break
    after = served.wait_until_idle()
    assert after["pagedserve_kv_cache_blocks{state=used,tier=device}"] == 0
    finished = "pagedserve_requests_total{outcome=finished}"
    assert after[finished] == before[finished]  # aborted, not run to its end
