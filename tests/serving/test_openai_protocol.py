"""The edge protocol against the official `openai` client: what it sends we parse, what we send it
parses. Requests are captured from the real client through an httpx transport; responses, stream
chunks and error bodies are fed back to the same client."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.engine.errors import EngineOverloaded
from cluster.engine.generation_defaults import ENGINE_DEFAULTS
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.error_map import http_error
from cluster.serving.openai_protocol import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionResponse,
    OpenAIError,
    TopLogprob,
    Usage,
    sse_event,
)
from cluster.serving.openai_requests import ChatCompletionRequest, CompletionRequest, parse_request
from cluster.serving.tenancy import Unauthenticated

Handler = Callable[[httpx.Request], httpx.Response]


def client_with(handler: Handler) -> openai.OpenAI:
    transport = httpx.MockTransport(handler)
    return openai.OpenAI(
        base_url="http://server/v1",
        api_key="sk-test",
        http_client=httpx.Client(transport=transport),
        max_retries=0,
    )


def captured_body(call: Callable[[openai.OpenAI], object]) -> tuple[str, bytes]:
    """The (path, raw JSON body) the real client sends for `call`."""
    seen: list[httpx.Request] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(418, json={"error": {"message": "captured", "type": "x"}})

    with pytest.raises(openai.APIStatusError):
        call(client_with(refuse))
    (request,) = seen
    return request.url.path, request.content


def test_completion_request_from_the_client_maps_to_sampling_params() -> None:
    path, body = captured_body(
        lambda c: c.completions.create(
            model="tiny",
            prompt="Once upon",
            max_tokens=7,
            temperature=0.5,
            top_p=0.9,
            n=2,
            stop=["\n", "."],
            seed=11,
            logprobs=3,
            stream=True,
            stream_options={"include_usage": True},
            user="alice",
            extra_body={"top_k": 5, "ignore_eos": True},
        )
    )
    assert path == "/v1/completions"
    request = parse_request(body, CompletionRequest)
    assert request.prompts() == ["Once upon"]
    assert request.include_usage
    params = SamplingParams(**request.sampling_kwargs(ENGINE_DEFAULTS))
    assert params == SamplingParams(
        n=2,
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        seed=11,
        stop=["\n", "."],
        logprobs=3,
        ignore_eos=True,
    )


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_every_prompt_shape_the_client_accepts(prompt: Any, expected: list[Any]) -> None:
    _, body = captured_body(lambda c: c.completions.create(model="tiny", prompt=prompt))
    request = parse_request(body, CompletionRequest)
    assert request.prompts() == expected
    # OpenAI's completions default
    assert request.sampling_kwargs(ENGINE_DEFAULTS)["max_tokens"] == 16


def test_chat_request_from_the_client_maps_to_messages_and_sampling_params() -> None:
    path, body = captured_body(
        lambda c: c.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                             {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Again"},
            ],
            max_completion_tokens=9,
            max_tokens=100,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stop="END",
        )
    )  # fmt: skip
    assert path == "/v1/chat/completions"
    request = parse_request(body, ChatCompletionRequest)
    assert request.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"},
    ]
    assert not request.include_usage
    params = SamplingParams(**request.sampling_kwargs(ENGINE_DEFAULTS))
    assert params == SamplingParams(max_tokens=9, temperature=0.0, stop=["END"], logprobs=2)


def test_chat_without_a_token_limit_runs_to_the_context_and_logprobs_false_reports_none() -> None:
    _, body = captured_body(
        lambda c: c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=False
        )
    )
    kwargs = parse_request(body, ChatCompletionRequest).sampling_kwargs(ENGINE_DEFAULTS)
    assert kwargs["max_tokens"] is None
    assert kwargs["logprobs"] is None


PENALTIES: dict[str, Any] = {
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "repetition_penalty": 1.2,
    "min_p": 0.05,
    "min_tokens": 3,
    "logit_bias": {"7": 5.5},
}
"""Valid values of every penalty field, as a body gives them."""
ENGINE_PENALTIES: dict[str, Any] = {**PENALTIES, "logit_bias": {7: 5.5}}
"""The same values as the engine's `SamplingParams` takes them."""
PENALTY_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "logit_bias": None,
}


def penalties_of(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {name: kwargs[name] for name in PENALTIES}


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": "x", "max_tokens": 8},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8},
    ],
)
def test_penalty_fields_reach_the_sampling_params(body: dict[str, Any]) -> None:
    model = CompletionRequest if "prompt" in body else ChatCompletionRequest
    kwargs = parse_request(json.dumps({**body, **PENALTIES}).encode(), model).sampling_kwargs(
        ENGINE_DEFAULTS
    )
    assert penalties_of(kwargs) == ENGINE_PENALTIES
    params = SamplingParams(**kwargs)
    assert penalties_of(vars(params)) == ENGINE_PENALTIES
    # Absent, null and an empty logit_bias all mean the engine's defaults.
    for extra in ({}, dict.fromkeys(PENALTIES), {"logit_bias": {}}):
        kwargs = parse_request(json.dumps({**body, **extra}).encode(), model).sampling_kwargs(
            ENGINE_DEFAULTS
        )
        assert penalties_of(kwargs) == PENALTY_DEFAULTS
        assert penalties_of(vars(SamplingParams(**kwargs))) == PENALTY_DEFAULTS


def test_penalty_bounds_are_inclusive_and_take_integers() -> None:
    body = {
        "model": "m",
        "prompt": "x",
        "max_tokens": 2,
        "frequency_penalty": -2,
        "presence_penalty": 2,
        "min_p": 1,
        "min_tokens": 2,
        "logit_bias": {"0": -100, "4294967295": 100},
    }
    kwargs = parse_request(json.dumps(body).encode(), CompletionRequest).sampling_kwargs(
        ENGINE_DEFAULTS
    )
    assert penalties_of(kwargs) == {
        "frequency_penalty": -2.0,
        "presence_penalty": 2.0,
        "repetition_penalty": 1.0,
        "min_p": 1.0,
        "min_tokens": 2,
        "logit_bias": {0: -100.0, 4294967295: 100.0},
    }
    SamplingParams(**kwargs)


def test_the_client_sends_penalties_as_vllm_users_do() -> None:
    """OpenAI's fields through the client's own keywords, vLLM's through `extra_body`."""
    extensions = {"repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 3}
    _, body = captured_body(
        lambda c: c.completions.create(
            model="tiny",
            prompt="x",
            max_tokens=8,
            frequency_penalty=0.5,
            presence_penalty=-0.5,
            logit_bias={"7": 5.5},
            extra_body=extensions,
        )
    )
    kwargs = parse_request(body, CompletionRequest).sampling_kwargs(ENGINE_DEFAULTS)
    assert penalties_of(kwargs) == ENGINE_PENALTIES
    _, body = captured_body(
        lambda c: c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_completion_tokens=8,
            frequency_penalty=0.5,
            presence_penalty=-0.5,
            logit_bias={"7": 5.5},
            extra_body=extensions,
        )
    )
    kwargs = parse_request(body, ChatCompletionRequest).sampling_kwargs(ENGINE_DEFAULTS)
    assert penalties_of(kwargs) == ENGINE_PENALTIES
    assert SamplingParams(**kwargs).max_tokens == 8


BAD_BODIES: list[tuple[type[Any], dict[str, Any], str | None, str]] = [
    (CompletionRequest, {"prompt": "x"}, "model", "Field required"),
    (CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens", "integer"),
    (CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    (CompletionRequest, {"model": "m", "prompt": []}, "prompt", "at least 1"),
    (CompletionRequest, {"model": "m", "prompt": [1, -2]}, "prompt", ""),
    (CompletionRequest, {"model": "m", "prompt": "x", "temperature": 3}, "temperature", "<= 2"),
    (CompletionRequest, {"model": "m", "prompt": "x", "top_p": 0}, "top_p", "> 0"),
    (CompletionRequest, {"model": "m", "prompt": "x", "n": 0}, "n", ">= 1"),
    (CompletionRequest, {"model": "m", "prompt": "x", "stream": "yes"}, "stream", "boolean"),
    (CompletionRequest, {"model": "m", "prompt": "x", "seed": -1}, "seed", ">= 0"),
    (CompletionRequest, {"model": "m", "prompt": "x", "stop": [""]}, "stop", "empty"),
    (
        CompletionRequest,
        {"model": "m", "prompt": "x", "echo": True, "stream": True},
        "echo",
        "not supported with stream",
    ),
    (CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 21}, "logprobs", "<= 20"),
    (
        CompletionRequest,
        {"model": "m", "prompt": "x", "prompt_logprobs": 21},
        "prompt_logprobs",
        "<= 20",
    ),
    (
        CompletionRequest,
        {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
        "stream_options",
        "only allowed when stream is true",
    ),
    *[
        (model, {**base, name: value}, name, fragment)
        for model, base in (
            (CompletionRequest, {"model": "m", "prompt": "x"}),
            (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
        )
        for name, value, fragment in [
            ("presence_penalty", 2.5, "<= 2"),
            ("frequency_penalty", -3, ">= -2"),
            ("repetition_penalty", 0, "> 0"),
            ("repetition_penalty", "1.1", "valid number"),
            ("repetition_penalty", math.inf, "finite"),
            ("min_p", 1.5, "<= 1"),
            ("min_tokens", -1, ">= 0"),
            ("min_tokens", 2.0, "integer"),
            ("logit_bias", {"abc": 1}, "token ids"),
            ("logit_bias", {"-5": 1}, "token ids"),
            ("logit_bias", {"5": 200}, "[-100, 100]"),
            ("logit_bias", [5], "an object"),
        ]
    ],
    (
        CompletionRequest,
        {"model": "m", "prompt": "x", "max_tokens": 4, "min_tokens": 5},
        "min_tokens",
        "must not exceed the request's max_tokens (4)",
    ),
    (
        ChatCompletionRequest,  # max_completion_tokens wins over max_tokens
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 50,
            "max_completion_tokens": 4,
            "min_tokens": 5,
        },
        "min_tokens",
        "must not exceed the request's max_tokens (4)",
    ),
    (ChatCompletionRequest, {"model": "m", "messages": []}, "messages", "at least 1"),
    (ChatCompletionRequest, {"model": "m", "messages": "hi"}, "messages", "valid array"),
    (
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
        "messages[0].role",
        "'system'",
    ),
    (
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
        "",
    ),
    (
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
            ],
        },
        "messages[1].content[0]",
        "'image_url' are not supported",
    ),
    (
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
        "requires logprobs",
    ),
    (
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"a": 1}]},
        "tools[0].type",
        "Field required",
    ),
    (
        CompletionRequest,
        {
            "model": "m",
            "prompt": "x",
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}},
        },
        "response_format.json_schema.schema",
        'Unsupported type "x"',
    ),
    (
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "structured_outputs": {"regex": "(?=a)b"},
        },
        "structured_outputs.regex",
        "Lookahead is not supported",
    ),
]


@pytest.mark.parametrize(("model", "body", "param", "fragment"), BAD_BODIES)
def test_bad_input_is_a_400_naming_the_parameter(
    model: type[Any], body: dict[str, Any], param: str | None, fragment: str
) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_request(json.dumps(body).encode(), model)
    error = caught.value
    assert error.status == 400
    assert error.param == param
    assert fragment in error.message.replace("greater than or equal to", ">=").replace(
        "less than or equal to", "<="
    ).replace("greater than", ">")
    assert error.body().error.type == "invalid_request_error"


@pytest.mark.parametrize("body", [b"", b"{", b"\xff\xfe", b"[1, 2]", b'"text"', b"null"])
def test_a_body_that_is_not_a_json_object_is_a_400(body: bytes) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_request(body, CompletionRequest)
    assert caught.value.status == 400
    assert "JSON" in caught.value.message


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "n", "stop", "temperature", "logprobs"]
FIELDS += ["top_logprobs", "stream", "stream_options", "seed", "top_k", "stop_token_ids"]
FIELDS += ["frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "min_tokens"]
FIELDS += ["logit_bias"]


@settings(deadline=None)
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6))
def test_any_json_object_either_parses_or_is_a_clean_400(body: dict[str, Any]) -> None:
    for model in (CompletionRequest, ChatCompletionRequest):
        try:
            request = parse_request(json.dumps(body).encode(), model)
        except OpenAIError as error:
            assert error.status == 400
            continue
        SamplingParams(
            **request.sampling_kwargs(ENGINE_DEFAULTS)
        )  # whatever parses is a valid engine request


def respond_with(status: int, payload: str, headers: dict[str, str] | None = None) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=payload.encode(), headers=headers)

    return handler


def test_the_client_parses_our_completion_response() -> None:
    response = CompletionResponse(
        id="cmpl-1",
        created=1,
        model="tiny",
        choices=[
            CompletionChoice(index=0, text=" a", finish_reason="length"),
            CompletionChoice(index=1, text=" b.", finish_reason="stop"),
        ],
        usage=Usage.of(prompt_tokens=4, completion_tokens=3, cached_tokens=2),
    )
    headers = {"content-type": "application/json"}
    client = client_with(respond_with(200, response.model_dump_json(), headers))
    parsed = client.completions.create(model="tiny", prompt="x", n=2)
    assert [(c.text, c.finish_reason) for c in parsed.choices] == [
        (" a", "length"),
        (" b.", "stop"),
    ]
    assert parsed.usage is not None
    assert parsed.usage.total_tokens == 7
    assert parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2


def test_the_client_parses_our_chat_response_with_logprobs() -> None:
    logprobs = ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token="Hi", logprob=-0.1, top_logprobs=[TopLogprob(token="Hi", logprob=-0.1)]
            )
        ]
    )
    response = ChatCompletionResponse(
        id="chatcmpl-1",
        created=1,
        model="tiny",
        choices=[
            ChatChoice(
                index=0,
                message=AssistantMessage(content="Hi"),
                logprobs=logprobs,
                finish_reason="stop",
            )
        ],
        usage=Usage.of(prompt_tokens=5, completion_tokens=1),
    )
    headers = {"content-type": "application/json"}
    client = client_with(respond_with(200, response.model_dump_json(), headers))
    parsed = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}]
    )
    (choice,) = parsed.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == "Hi"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert choice.logprobs.content[0].top_logprobs[0].logprob == pytest.approx(-0.1)


def chat_stream(pieces: list[str]) -> Iterator[str]:
    """The event sequence a chat stream sends: role first, text deltas, finish, usage, [DONE]."""
    base = {"id": "chatcmpl-2", "created": 1, "model": "tiny"}
    yield sse_event(
        ChatCompletionChunk(
            **base, choices=[ChatChunkChoice(index=0, delta=ChatDelta(role="assistant"))]
        )
    )
    for piece in pieces:
        choice = ChatChunkChoice(index=0, delta=ChatDelta(content=piece))
        yield sse_event(ChatCompletionChunk(**base, choices=[choice]))
    final = ChatChunkChoice(index=0, delta=ChatDelta(), finish_reason="length")
    yield sse_event(ChatCompletionChunk(**base, choices=[final]))
    usage = Usage.of(prompt_tokens=3, completion_tokens=len(pieces))
    yield sse_event(ChatCompletionChunk(**base, choices=[], usage=usage))
    yield SSE_DONE


def test_the_client_streams_our_sse_chunks_to_the_end() -> None:
    payload = "".join(chat_stream(["Hel", "lo", " world"]))
    headers = {"content-type": "text/event-stream"}
    client = client_with(respond_with(200, payload, headers))
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("error", "client_error"),
    [
        (OpenAIError(400, "bad", param="n"), openai.BadRequestError),
        (http_error(Unauthenticated("no key")), openai.AuthenticationError),
        (http_error(EngineOverloaded("queue full", retry_after_s=2)), openai.InternalServerError),
    ],
)
def test_the_client_reads_our_error_bodies(
    error: OpenAIError, client_error: type[openai.APIStatusError]
) -> None:
    headers = {"content-type": "application/json", **error.headers}
    client = client_with(respond_with(error.status, error.body().model_dump_json(), headers))
    with pytest.raises(client_error) as caught:
        client.completions.create(model="tiny", prompt="x")
    assert caught.value.status_code == error.status
    # The client found the message inside OpenAI's error shape (else it shows the whole body).
    assert caught.value.message == f"Error code: {error.status} - {error.message}"
    assert caught.value.body == error.body().error.model_dump()
    assert caught.value.code == error.code
    assert caught.value.param == error.param
    if error.status == 503:
        assert caught.value.response.headers["retry-after"] == "2"
