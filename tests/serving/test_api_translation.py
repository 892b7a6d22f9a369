"""The Responses and Messages APIs without Ray or a model: their requests translate into the
chat fields the chat path runs (and refuse bad input naming the field as each API spells it),
their stream encoders emit the event sequences the official SDKs' own types accept (the SDKs'
pydantic models and Anthropic's accumulator are the oracles), and the Responses store is bounded
and per tenant."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic.types
import openai.types.responses
import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from cluster.engine.output_stream import BranchDelta, RequestDelta
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.anthropic_events import MessageEncoder, error_body
from cluster.serving.anthropic_requests import (
    ANTHROPIC_NAMES,
    MessagesRequest,
    parse_messages_request,
)
from cluster.serving.chat_bridge import (
    CallArguments,
    CallStart,
    ChatRun,
    Finished,
    ParamNames,
    Started,
    TextPiece,
    chat_pieces,
    chat_request_of,
)
from cluster.serving.frontend import Submission
from cluster.serving.openai_protocol import OpenAIError
from cluster.serving.responses_events import ResponseEncoder
from cluster.serving.responses_requests import (
    RESPONSES_NAMES,
    ResponsesRequest,
    parse_responses_request,
)
from cluster.serving.responses_store import ResponseStore, StoredResponse
from cluster.serving.tool_calls import ToolDef, ToolSettings, plan_tools

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def _refusal(parse: Any, names: ParamNames, **fields: Any) -> OpenAIError:
    """The 400 a body gets on its way to the engine: its own parse, then the chat path's
    checks (translated into the API's names, as `chat_bridge.start_chat` does)."""
    with pytest.raises(OpenAIError) as caught:
        request = parse(_body(**fields))
        try:
            if isinstance(request, ResponsesRequest):
                chat_fields = request.chat_fields(request.conversation([]))
            else:
                chat_fields = request.chat_fields()
            chat_request_of(chat_fields).tool_plan(ToolSettings(True, "hermes"))
        except OpenAIError as error:
            raise names.translate(error) from None
    assert caught.value.status == 400
    return caught.value


def test_responses_items_become_one_chat_conversation() -> None:
    request = parse_responses_request(
        _body(
            instructions="Be brief.",
            input=[
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                             {"type": "input_text", "text": "Paris?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"a":1}'},
                {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            tools=[{"type": "function", "name": "get", "parameters": SCHEMA}],
            tool_choice={"type": "function", "name": "get"},
            max_output_tokens=7,
            text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
        )
    )  # fmt: skip
    history = [{"role": "user", "content": "before"}]
    fields = request.chat_fields(request.conversation(history))
    assert fields["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "before"},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get", "arguments": '{"a":1}'}},
                {"id": "c2", "type": "function",
                 "function": {"name": "get", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]  # fmt: skip
    assert fields["tools"] == [
        {"type": "function", "function": {"name": "get", "parameters": SCHEMA}}
    ]
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    assert fields["max_completion_tokens"] == 7
    assert fields["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": SCHEMA},
    }
    chat = chat_request_of(fields)  # the chat path accepts what the translation makes
    assert chat.constraint() is not None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "input_image"}]}, "input[0].type"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}},
         "text.format.schema"),
        ({"input": "x",
          "text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
         "text.format.schema"),
        ({"input": "x", "temperature": 3}, "temperature"),
    ],
)  # fmt: skip
def test_responses_refusals_name_the_responses_field(fields: dict[str, Any], param: str) -> None:
    error = _refusal(parse_responses_request, RESPONSES_NAMES, **fields)
    assert error.param == param and param in error.message


def test_messages_blocks_become_chat_messages_and_tool_choices_map() -> None:
    request = parse_messages_request(
        _body(
            max_tokens=5,
            system=[{"type": "text", "text": "Sys."}],
            messages=[
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "get", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1",
                     "content": [{"type": "text", "text": "rain"}]},
                    {"type": "text", "text": "And tomorrow?"}]},
            ],
            tools=[{"name": "get", "description": "d", "input_schema": SCHEMA}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            stop_sequences=["\n\n"],
            top_k=5,
        )
    )  # fmt: skip
    fields = request.chat_fields()
    assert fields["messages"] == [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "get", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "rain", "tool_call_id": "t1"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    assert fields["tools"][0]["function"] == {
        "name": "get",
        "parameters": SCHEMA,
        "description": "d",
    }
    assert (fields["tool_choice"], fields["parallel_tool_calls"]) == ("required", False)
    assert (fields["stop"], fields["top_k"], fields["max_completion_tokens"]) == (["\n\n"], 5, 5)
    chat_request_of(fields)
    for choice, expected in [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get"}, {"type": "function", "function": {"name": "get"}}),
    ]:
        translated = MessagesRequest.model_validate({**request.model_dump(), "tool_choice": choice})
        assert translated.chat_fields()["tool_choice"] == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5},
         "temperature"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
         "messages[0].content[0].type"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
          "tools": [{"name": "f", "input_schema": {"type": "nonsense"}}],
          "tool_choice": {"type": "any"}},
         "tools[0].input_schema"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]},
         "stop_sequences"),
    ],
)  # fmt: skip
def test_messages_refusals_name_the_anthropic_field(fields: dict[str, Any], param: str) -> None:
    error = _refusal(parse_messages_request, ANTHROPIC_NAMES, **fields)
    assert error.param == param
    body = error_body(error)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert param in body["error"]["message"]


PIECES = [
    Started(prompt_tokens=9, cached_tokens=4),
    TextPiece("Hel"),
    TextPiece("lo"),
    CallStart(0, "call_1", "get"),
    CallArguments(0, '{"city": '),
    CallArguments(0, '"Oslo"}'),
    CallStart(1, "call_2", "get"),
    CallArguments(1, "{}"),
    Finished("tool_calls", None, prompt_tokens=9, completion_tokens=6, cached_tokens=4),
]


def test_response_events_are_the_sdks_typed_sequence() -> None:
    request = parse_responses_request(_body(input="hi"))
    encoder = ResponseEncoder(request, SamplingParams(), "resp_1", "m")
    events = encoder.start() + [e for piece in PIECES for e in encoder.feed(piece)]
    adapter = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    typed = [adapter.validate_python(event) for event in events]
    assert [event.sequence_number for event in typed] == list(range(len(events)))
    assert [e.type for e in typed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = typed[-1].response  # type: ignore[union-attr]
    assert final.output_text == "Hello" and final.status == "completed"
    assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == [
        ("message", None),
        ("function_call", '{"city": "Oslo"}'),
        ("function_call", "{}"),
    ]
    done = [e for e in typed if e.type == "response.output_item.done"]
    assert [e.item for e in done] == final.output  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == 4


def test_response_cut_by_the_limit_is_incomplete() -> None:
    encoder = ResponseEncoder(
        parse_responses_request(_body(input="hi")), SamplingParams(), "resp_1", "m"
    )
    encoder.start()
    encoder.feed(TextPiece("x"))
    last = encoder.feed(Finished("length", None, 3, 1, 0))[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize(
    ("finished", "stop_reason"),
    [
        (Finished("tool_calls", None, 9, 6, 4), "tool_use"),
        (Finished("stop", "###", 9, 6, 4), "stop_sequence"),
        (Finished("stop", None, 9, 6, 4), "end_turn"),
        (Finished("length", None, 9, 6, 4), "max_tokens"),
    ],
)
def test_message_events_accumulate_in_anthropics_client(
    finished: Finished, stop_reason: str
) -> None:
    encoder = MessageEncoder("msg_1", "m")
    events = [e for piece in [*PIECES[:-1], finished] for e in encoder.feed(piece)]
    adapter = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == [
        "message_delta",
        "message_stop",
    ]
    snapshot = None
    buffers: dict[int, bytes] = {}
    for event in events:
        if event["type"] == "ping":
            continue
        snapshot = accumulate_event(
            event=adapter.validate_python(event), current_snapshot=snapshot, json_bufs=buffers
        )
    assert snapshot is not None
    assert [block.type for block in snapshot.content] == ["text", "tool_use", "tool_use"]
    assert snapshot.content[0].text == "Hello"  # type: ignore[union-attr]
    assert snapshot.content[1].input == {"city": "Oslo"}  # type: ignore[union-attr]
    assert (snapshot.stop_reason, snapshot.stop_sequence) == (stop_reason, finished.stop_sequence)
    usage = snapshot.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens) == (5, 4, 6)


def test_store_is_bounded_and_per_tenant() -> None:
    store = ResponseStore(max_entries=2)
    for name in ("a", "b", "c"):
        store.put(b"alice", name, StoredResponse({"id": name}, []))
    assert store.get(b"alice", "a") is None and len(store) == 2
    assert store.get(b"bob", "b") is None and store.get(b"alice", "b") is not None
    assert not store.delete(b"bob", "c") and store.delete(b"alice", "c")
    assert store.get(b"alice", "c") is None


def _delta(text: str, *, first: bool = False, finish: str | None = None) -> RequestDelta:
    return RequestDelta(
        request_id="r",
        branches=[BranchDelta(index=0, text=text, token_ids=[7], finish_reason=finish)],
        finished=finish is not None,
        num_cached_tokens=2,
        prompt_token_ids=[1, 2, 3] if first else None,
    )


def test_chat_pieces_read_calls_out_of_the_text_and_close_the_engine_stream() -> None:
    closed = []

    async def engine_stream() -> AsyncIterator[RequestDelta]:
        try:
            yield _delta("Sure. ", first=True)
            yield _delta('<tool_call>\n{"name": "get", "arguments": {"city"')
            yield _delta(': "Oslo"}}\n</tool_call>', finish="stop")
        finally:
            closed.append(True)

    tool = {"type": "function", "function": {"name": "get", "parameters": SCHEMA}}
    request = chat_request_of({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    plan = plan_tools([ToolDef.model_validate(tool)], None, None, ToolSettings(True, "hermes"))
    run = ChatRun(request, plan, SamplingParams(), Submission([engine_stream()], None, None))

    async def read() -> list[Any]:
        return [piece async for piece in chat_pieces(run)]

    pieces = asyncio.run(read())
    assert pieces[0] == Started(prompt_tokens=3, cached_tokens=2)
    assert "".join(p.text for p in pieces if isinstance(p, TextPiece)).strip() == "Sure."
    (start,) = [p for p in pieces if isinstance(p, CallStart)]
    assert (start.index, start.name) == (0, "get")
    arguments = "".join(p.text for p in pieces if isinstance(p, CallArguments))
    assert json.loads(arguments) == {"city": "Oslo"}
    assert pieces[-1] == Finished("tool_calls", None, 3, 3, 2)
    assert closed == [True]
