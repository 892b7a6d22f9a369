"""Structured outputs on gRPC `Generate`: the `structured_outputs` message constrains the output
(checked with `re` and `jsonschema`) through Ray Serve's gRPC proxy, and a constraint HTTP
refuses is INVALID_ARGUMENT with the very message HTTP's 400 carries (one validation)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import grpc
import jsonschema
import pytest

from cluster.engine.generation_defaults import ENGINE_DEFAULTS
from cluster.serving.grpc_validation import GrpcAbort, validate_generate, validated_generate
from cluster.serving.openai_protocol import OpenAIError
from cluster.serving.openai_requests import CompletionRequest, parse_request
from protos import generation_pb2 as pb
from protos import generation_pb2_grpc as pb_grpc
from tests.serving.conftest import MODEL, Served

KEY = (("authorization", "Bearer key-alice"),)
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("proto", "http"),
    [
        (pb.StructuredOutputs(regex="(?=a)b"), {"regex": "(?=a)b"}),
        (pb.StructuredOutputs(json='{"type": "nope"}'), {"json": {"type": "nope"}}),
        (pb.StructuredOutputs(grammar="root ::= "), {"grammar": "root ::= "}),
        (pb.StructuredOutputs(choice=pb.Choices()), {"choice": []}),
    ],
)
def test_refusals_match_http(proto: pb.StructuredOutputs, http: dict[str, object]) -> None:
    request = pb.GenerateRequest(text="Hi", structured_outputs=proto)
    with pytest.raises(GrpcAbort) as grpc_error:
        validated_generate(request)
    assert grpc_error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    body = {"model": "m", "prompt": "Hi", "structured_outputs": http}
    with pytest.raises(OpenAIError) as http_error:
        parse_request(json.dumps(body).encode(), CompletionRequest)
    assert grpc_error.value.details == http_error.value.message
    assert f"structured_outputs.{next(iter(http))}" in grpc_error.value.details


def test_constraints_reach_the_sampling_params() -> None:
    request = pb.GenerateRequest(
        text="Hi",
        structured_outputs=pb.StructuredOutputs(json=json.dumps(SCHEMA)),
    )
    _, params = validated_generate(request)
    assert params.structured_outputs is not None
    assert params.structured_outputs.spec.kind == "json"


@pytest.fixture(scope="module")
def stub(served: Served) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(served.grpc_target) as channel:
        yield pb_grpc.GenerationStub(channel)


def test_generate_is_constrained(stub: pb_grpc.GenerationStub) -> None:
    def text_of(constraint: pb.StructuredOutputs, seed: int) -> tuple[str, int]:
        request = pb.GenerateRequest(
            model=MODEL,
            text="Answer:",
            sampling=pb.SamplingParameters(max_tokens=30, seed=seed),
            structured_outputs=constraint,
        )
        responses = list(stub.Generate(request, metadata=KEY))
        deltas = [choice for r in responses for choice in r.choices]
        return "".join(d.text for d in deltas), deltas[-1].finish_reason

    text, reason = text_of(pb.StructuredOutputs(regex=r"[0-9]{2}-[a-z]{2}"), 1)
    assert reason == pb.FINISH_REASON_STOP and re.fullmatch(r"[0-9]{2}-[a-z]{2}", text)
    text, _ = text_of(pb.StructuredOutputs(choice=pb.Choices(choices=["left", "right"])), 2)
    assert text in {"left", "right"}
    schema = pb.StructuredOutputs(json=json.dumps(SCHEMA), disable_any_whitespace=True)
    text, reason = text_of(schema, 3)
    assert reason == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads(text), SCHEMA)
    with pytest.raises(grpc.RpcError) as caught:
        text_of(pb.StructuredOutputs(regex="(?=a)"), 4)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.regex" in (caught.value.details() or "")


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
CHAT = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Weather in Oslo?")])
TOOL = pb.Tool(name="get_weather", parameters_json=json.dumps(WEATHER))


def test_tool_refusals_match_http() -> None:
    from cluster.serving.openai_requests import ChatCompletionRequest
    from cluster.serving.tool_calls import ToolSettings

    request = pb.GenerateRequest(
        chat=CHAT, tools=[TOOL], tool_choice=pb.ToolChoice(function="nope")
    )
    with pytest.raises(GrpcAbort) as grpc_error:
        validate_generate(request, ToolSettings(), None, defaults=ENGINE_DEFAULTS)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        "tool_choice": {"type": "function", "function": {"name": "nope"}},
    }
    parsed = parse_request(json.dumps(body).encode(), ChatCompletionRequest)
    with pytest.raises(OpenAIError) as http_error:
        parsed.tool_plan(ToolSettings())
    assert grpc_error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_error.value.details == http_error.value.message
    with pytest.raises(GrpcAbort, match="chat prompt"):
        validate_generate(
            pb.GenerateRequest(text="Hi", tools=[TOOL]),
            ToolSettings(),
            None,
            defaults=ENGINE_DEFAULTS,
        )


def test_generate_with_a_required_tool_streams_the_call(stub: pb_grpc.GenerationStub) -> None:
    request = pb.GenerateRequest(
        model=MODEL,
        chat=CHAT,
        sampling=pb.SamplingParameters(max_tokens=60, seed=1),
        tools=[TOOL],
        tool_choice=pb.ToolChoice(mode="required"),
        parallel_tool_calls=False,
    )
    deltas = [c for r in stub.Generate(request, metadata=KEY) for c in r.choices]
    calls = [call for d in deltas for call in d.tool_calls]
    assert calls and calls[0].name == "get_weather" and calls[0].id
    assert all(not call.name for call in calls[1:])
    jsonschema.validate(json.loads("".join(call.arguments for call in calls)), WEATHER)
    assert deltas[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
