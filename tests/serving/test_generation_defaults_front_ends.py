"""Every front end gives a request's unset sampling fields the model's generation defaults, and
only those: the bodies the official `openai` and `anthropic` clients send (and gRPC messages)
go through each API's own parsing and the chat path's, as the routes run them; an explicit
value, 1.0 and 0 included, always wins."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from cluster.engine.generation_defaults import ENGINE_DEFAULTS, GenerationDefaults
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.anthropic_requests import parse_messages_request
from cluster.serving.chat_bridge import chat_request_of
from cluster.serving.grpc_validation import validated_generate
from cluster.serving.openai_protocol import OpenAIError
from cluster.serving.openai_requests import ChatCompletionRequest, CompletionRequest, parse_request
from cluster.serving.openai_serving import OpenAIServing
from cluster.serving.responses_events import ResponseEncoder
from cluster.serving.responses_requests import parse_responses_request
from protos import generation_pb2 as pb

MODEL = GenerationDefaults(
    temperature=0.3, top_p=0.8, top_k=7, min_p=0.05, repetition_penalty=1.2, max_tokens=33
)
"""A model recommending every field we read (none equal to the engine's own)."""

SAMPLED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
EXPLICIT_ENGINE_VALUES = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "max_tokens": 33,
}
"""Explicit values equal to the engine's own defaults (and one equal to the model's limit):
they must win over the model's, not be mistaken for unset."""


def _sampled(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in SAMPLED}


def _captured(send: Callable[[Any], object], http: Any = httpx) -> bytes:
    """The raw JSON body an official client sends through `http` (the `httpx` package the
    SDK takes: `openai` httpx, `anthropic` httpx2); the mock server refuses it."""
    seen: list[Any] = []

    def refuse(request: Any) -> Any:
        seen.append(request)
        return http.Response(418, json={"error": {"message": "captured", "type": "x"}})

    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)):
        send(http.Client(transport=http.MockTransport(refuse)))
    (request,) = seen
    return request.content


def _openai(http: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://s/v1", api_key="k", http_client=http, max_retries=0)


def _anthropic(http: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://s", api_key="k", http_client=http, max_retries=0)


def _serving(defaults: GenerationDefaults) -> OpenAIServing:
    """OpenAI serving over a front end that holds only what building parameters reads."""
    frontend = SimpleNamespace(
        renderer=SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None)),
        generation_defaults=defaults,
    )
    return OpenAIServing(frontend, "m")  # type: ignore[arg-type]


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _chat_params(defaults: GenerationDefaults, **fields: Any) -> SamplingParams:
    body = _captured(
        lambda h: _openai(h).chat.completions.create(model="m", messages=MESSAGES, **fields)  # type: ignore[arg-type]
    )
    return _serving(defaults).sampling_params(parse_request(body, ChatCompletionRequest))


def _completion_params(defaults: GenerationDefaults, **fields: Any) -> SamplingParams:
    body = _captured(lambda h: _openai(h).completions.create(model="m", prompt="x", **fields))
    return _serving(defaults).sampling_params(parse_request(body, CompletionRequest))


def _responses_params(defaults: GenerationDefaults, **fields: Any) -> SamplingParams:
    body = _captured(lambda h: _openai(h).responses.create(model="m", input="x", **fields))
    request = parse_responses_request(body)
    chat = chat_request_of(request.chat_fields(request.conversation([])))  # start_chat's path
    return _serving(defaults).sampling_params(chat)


def _messages_params(defaults: GenerationDefaults, **fields: Any) -> SamplingParams:
    body = _captured(
        lambda h: _anthropic(h).messages.create(
            model="m",
            messages=MESSAGES,  # type: ignore[arg-type]
            **{"max_tokens": 33, **fields},
        ),
        httpx2,
    )
    chat = chat_request_of(parse_messages_request(body).chat_fields())  # start_chat's path
    return _serving(defaults).sampling_params(chat)


def _grpc_params(defaults: GenerationDefaults, **fields: Any) -> SamplingParams:
    sampling = pb.SamplingParameters(**fields)
    return validated_generate(pb.GenerateRequest(text="x", sampling=sampling), defaults)[1]


def test_openai_chat_and_completions_unset_fields_take_the_models_defaults() -> None:
    """The official client sends no sampling field unless asked: all six are the model's."""
    assert _sampled(_chat_params(MODEL)) == MODEL.given()
    assert _sampled(_completion_params(MODEL)) == MODEL.given()
    engine = _chat_params(ENGINE_DEFAULTS)  # --generation-config vllm: OpenAI's nominal 1.0
    assert (engine.temperature, engine.top_p, engine.top_k, engine.max_tokens) == (1.0, 1, 0, None)
    assert _completion_params(ENGINE_DEFAULTS).max_tokens == 16  # OpenAI's completions default


def test_openai_explicit_values_win_even_the_engines_own() -> None:
    explicit = {k: v for k, v in EXPLICIT_ENGINE_VALUES.items() if k in ("temperature", "top_p")}
    vllm_fields = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    chat = _chat_params(MODEL, **explicit, max_completion_tokens=33, extra_body=vllm_fields)
    assert _sampled(chat) == EXPLICIT_ENGINE_VALUES
    completion = _completion_params(MODEL, **explicit, max_tokens=33, extra_body=vllm_fields)
    assert _sampled(completion) == EXPLICIT_ENGINE_VALUES
    assert _chat_params(MODEL, temperature=0).temperature == 0.0
    assert _chat_params(MODEL, extra_body={"top_k": -1}).top_k == 0  # vLLM's "off"
    null = json.dumps({"model": "m", "messages": MESSAGES, "temperature": None}).encode()
    assert (
        _serving(MODEL).sampling_params(parse_request(null, ChatCompletionRequest)).temperature
        == 0.3
    )


def test_a_default_token_limit_below_min_tokens_is_a_400_naming_min_tokens() -> None:
    for defaults, limit in ((ENGINE_DEFAULTS, 16), (MODEL, 33)):
        body = json.dumps({"model": "m", "prompt": "x", "min_tokens": limit + 1}).encode()
        with pytest.raises(OpenAIError) as caught:
            _serving(defaults).sampling_params(parse_request(body, CompletionRequest))
        assert caught.value.param == "min_tokens"
        assert f"must not exceed the request's max_tokens ({limit})" in caught.value.message
    body = json.dumps({"model": "m", "prompt": "x", "min_tokens": 20}).encode()
    assert _serving(MODEL).sampling_params(parse_request(body, CompletionRequest)).min_tokens == 20


def test_responses_unset_fields_take_the_defaults_and_the_response_reports_them() -> None:
    params = _responses_params(MODEL)
    assert _sampled(params) == MODEL.given()
    request = parse_responses_request(json.dumps({"model": "m", "input": "x"}).encode())
    shown = ResponseEncoder(request, params, "resp_1", "m").response(None)
    assert (shown["temperature"], shown["top_p"]) == (0.3, 0.8)
    explicit = _responses_params(MODEL, temperature=1.0, top_p=1.0, max_output_tokens=20)
    assert (explicit.temperature, explicit.top_p, explicit.max_tokens) == (1.0, 1.0, 20)
    assert _responses_params(MODEL, temperature=0).temperature == 0.0


def test_anthropic_messages_unset_fields_take_the_defaults() -> None:
    params = _messages_params(MODEL)  # max_tokens is required by Anthropic's API
    assert _sampled(params) == MODEL.given()
    # this SDK's `create` has no sampling arguments: they go in the body as the API spells them
    explicit = _messages_params(MODEL, extra_body={"temperature": 1.0, "top_p": 1.0, "top_k": 0})
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (1.0, 1.0, 0)
    assert _messages_params(MODEL, extra_body={"temperature": 0}).temperature == 0.0


def test_grpc_unset_fields_take_the_defaults_and_set_ones_win() -> None:
    assert _sampled(_grpc_params(MODEL)) == MODEL.given()
    assert _grpc_params(ENGINE_DEFAULTS).max_tokens == 16  # gRPC's documented default
    explicit = _grpc_params(
        MODEL, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=33
    )
    assert _sampled(explicit) == EXPLICIT_ENGINE_VALUES
    assert _grpc_params(MODEL, temperature=0.0).temperature == 0.0
