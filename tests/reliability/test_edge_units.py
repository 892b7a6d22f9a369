"""Fast, in-process checks of the edge's refusals: deep JSON, gRPC sharing HTTP's validation,
lenient protobuf deserialization, and the limits section of the app's args."""

from __future__ import annotations

import json
import math

import grpc
import pytest
from pydantic import ValidationError

from cluster.engine.output_stream import BranchDelta, RequestDelta
from cluster.engine.outputs import Logprob
from cluster.serving.app_args import ServeAppArgs
from cluster.serving.grpc_service import GenerateStreamEncoder
from cluster.serving.grpc_validation import CorruptRequest, GrpcAbort, validated_generate
from cluster.serving.grpc_wire import LenientDeserializer
from cluster.serving.openai_protocol import OpenAIError
from cluster.serving.openai_requests import CompletionRequest, parse_request
from protos import generation_pb2 as pb


def sampled(**fields: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="x", sampling=pb.SamplingParameters(**fields))


@pytest.mark.parametrize("opening", [b"[", b'{"a":'])
def test_json_nested_100000_levels_is_a_400_not_a_recursion_error(opening: bytes) -> None:
    closing = b"]" if opening == b"[" else b"}"
    with pytest.raises(OpenAIError) as caught:
        parse_request(opening * 100_000 + b"1" + closing * 100_000, CompletionRequest)
    assert caught.value.status == 400


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (
            pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard")])),
            "role",
        ),
        (sampled(temperature=math.inf), "temperature"),
        (sampled(temperature=math.nan), "temperature"),
        (sampled(stop=["s"] * 1000), "stop"),
        (sampled(stop=["x" * 2000]), "stop"),
        (sampled(n=1000), "'n'"),
        (sampled(logprobs=21), "logprobs"),
        (pb.GenerateRequest(chat=pb.ChatMessages()), "messages"),
    ],
)
def test_grpc_refuses_what_http_refuses_with_the_same_message(
    request_: pb.GenerateRequest, param: str
) -> None:
    with pytest.raises(GrpcAbort) as caught:
        validated_generate(request_)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert param in caught.value.details


GRPC_PENALTIES = {
    "presence_penalty": -0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.25,
    "min_p": 0.0625,
    "min_tokens": 3,
    "logit_bias": {7: 5.5},
    "allowed_token_ids": [3, 7, 11],
    "bad_words": ["spam", "eggs and ham"],
    "truncate_prompt_tokens": 5,
    "prompt_logprobs": 2,
}
"""Valid values, exact in float32 (the proto's float)."""


@pytest.mark.parametrize(
    "prompt",
    [
        {"text": "x"},
        {"token_ids": pb.TokenIds(ids=[1, 2])},
        {"chat": pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")])},
    ],
)
def test_grpc_penalty_fields_reach_the_sampling_params(prompt: dict[str, object]) -> None:
    sampling = pb.SamplingParameters(max_tokens=8, **GRPC_PENALTIES)  # type: ignore[arg-type]
    _, params = validated_generate(pb.GenerateRequest(**prompt, sampling=sampling))
    assert {name: getattr(params, name) for name in GRPC_PENALTIES} == GRPC_PENALTIES
    _, unset = validated_generate(pb.GenerateRequest(**prompt))
    assert (unset.presence_penalty, unset.frequency_penalty, unset.repetition_penalty) == (0, 0, 1)
    assert (unset.min_p, unset.min_tokens, unset.logit_bias) == (0.0, 0, None)
    assert (unset.allowed_token_ids, unset.bad_words) == (None, None)
    assert unset.truncate_prompt_tokens is None and unset.prompt_logprobs is None


@pytest.mark.parametrize(
    ("proto", "http"),
    [
        ({"presence_penalty": 2.5}, {"presence_penalty": 2.5}),
        ({"frequency_penalty": -3.0}, {"frequency_penalty": -3.0}),
        ({"repetition_penalty": 0.0}, {"repetition_penalty": 0.0}),
        ({"repetition_penalty": math.inf}, {"repetition_penalty": math.inf}),
        ({"min_p": 1.5}, {"min_p": 1.5}),
        ({"min_tokens": 17}, {"min_tokens": 17, "max_tokens": 16}),  # gRPC's default limit: 16
        ({"max_tokens": 4, "min_tokens": 5}, {"max_tokens": 4, "min_tokens": 5}),
        ({"logit_bias": {5: 200.0}}, {"logit_bias": {"5": 200.0}}),
        ({"bad_words": ["ok", " "]}, {"bad_words": ["ok", " "]}),
        ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": 0}),
        ({"truncate_prompt_tokens": -2}, {"truncate_prompt_tokens": -2}),
        ({"prompt_logprobs": 21}, {"prompt_logprobs": 21}),
    ],
)
def test_grpc_refuses_bad_penalties_with_the_http_message(
    proto: dict[str, object], http: dict[str, object]
) -> None:
    with pytest.raises(GrpcAbort) as grpc_error:
        validated_generate(sampled(**proto))
    assert grpc_error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    body = {"model": "m", "prompt": "x", **http}
    with pytest.raises(OpenAIError) as http_error:
        parse_request(json.dumps(body).encode(), CompletionRequest)
    assert grpc_error.value.details == http_error.value.message
    field = next(name for name in proto if name != "max_tokens")
    assert f"'{field}" in grpc_error.value.details or f"{field} (" in grpc_error.value.details


def test_grpc_defaults_match_the_documented_ones() -> None:
    prompt, params = validated_generate(pb.GenerateRequest(text="hi"))
    assert prompt == "hi"
    assert (params.n, params.max_tokens, params.temperature, params.logprobs) == (1, 16, 1.0, None)


def test_corrupt_bytes_become_a_corrupt_request_and_valid_bytes_parse_as_generated() -> None:
    parse = LenientDeserializer(pb.GenerateRequest.FromString)
    corrupt = parse(b"\x0f\xff")
    assert isinstance(corrupt, CorruptRequest)
    assert corrupt.message_type == "pagedserve.v1.GenerateRequest"
    assert parse(pb.GenerateRequest(text="hi").SerializeToString()) == pb.GenerateRequest(text="hi")


def test_limits_defaults_and_metrics_port_validation() -> None:
    args = ServeAppArgs.model_validate({})
    assert args.limits.max_body_bytes == 4 * 1024 * 1024
    assert args.limits.metrics.access == "open"
    with pytest.raises(ValidationError, match=r"metrics\.port"):
        ServeAppArgs.model_validate({"limits": {"metrics": {"access": "port"}}})
    with_port = {"limits": {"metrics": {"access": "port", "port": 9100}}}
    assert ServeAppArgs.model_validate(with_port).limits.metrics.port == 9100


def test_grpc_sends_the_prompt_logprobs_once_on_the_response_that_has_them() -> None:
    encoder = GenerateStreamEncoder(lambda ids: "".join(f"<{i}>" for i in ids))
    entries = [None, Logprob(7, -1.5, {9: -0.5, 7: -1.5}), Logprob(3, -2.0, {})]
    first = encoder.encode(
        RequestDelta(
            "r",
            [BranchDelta(0, "a", [5])],
            False,
            0,
            prompt_token_ids=[1, 7, 3],
            prompt_logprobs=entries,
        )
    )
    assert first is not None
    shown = [
        (p.sampled.token_id, p.sampled.logprob, [(t.token_id, t.logprob) for t in p.top])
        for p in first.prompt_logprobs
    ]
    assert shown == [(7, -1.5, [(9, -0.5), (7, -1.5)]), (3, -2.0, [])]
    assert first.prompt_logprobs[0].sampled.token == "<7>"
    later = encoder.encode(RequestDelta("r", [BranchDelta(0, "b", [6])], True, 0))
    assert later is not None and not later.prompt_logprobs
