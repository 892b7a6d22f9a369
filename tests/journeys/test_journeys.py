"""What a user does with the shipped server and model (SmolLM2-135M-Instruct), and what they see:
the README's three examples, chat with and without streaming, tools with no server flags,
`response_format` from a pydantic model through `.parse`, a LoRA adapter picked by model name,
gRPC, and finally the stop: SIGTERM to the process group.

All of it drives the one `pagedserve serve` process of `tests/journeys/conftest.py` (started as
`make serve` starts it, plus its ports and the LoRA flags); the stop is the module's last test.
Greedy decoding (`temperature: 0`) wherever the text is checked, so the checks are exact.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import grpc
import httpx
import jsonschema
import openai
import pydantic
import pytest
import yaml

from cluster.serving.cli_serve import shipped_serve_config
from protos import generation_pb2 as pb
from protos import generation_pb2_grpc as pb_grpc
from tests.journeys.run_examples import KeptEngines
from tests.journeys.user_server import UserServer, answers

pytestmark = [pytest.mark.ray, pytest.mark.own_ray]

MODEL = "SmolLM2-135M-Instruct"
CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
"""Not the bare question: its first token is a near-tie (0.08 logits in float32)."""
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WEATHER_PARAMETERS,
        },
    }
]
WEATHER_QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_TOKENS = 96
"""Room for a call and its tags; a bound as a user sets one, so a call SmolLM2 repeats ends."""


@pytest.fixture
def client(live_server: UserServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url, api_key="unused", max_retries=0)


def _greedy_chat(client: openai.OpenAI, model: str = MODEL, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=CAPITAL, max_tokens=24, temperature=0, **extra
    )


# --- the README's three examples ------------------------------------------------------------


def test_readme_offline_llm_knows_the_capital(
    kept_engines: KeptEngines, user_server: UserServer
) -> None:
    """In process, while the shared server (launched by asking for it) starts up."""
    from pagedserve import SamplingParams

    llm = kept_engines.llm()  # what `LLM()` loads: SmolLM2-135M-Instruct in process
    outs = llm.generate(
        ["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=16)
    )
    (completion,) = outs[0].outputs
    assert completion.text.split()[0].strip(".,") == "Paris"
    assert len(completion.token_ids) <= 16


def test_readme_streaming_chat_names_colours(client: openai.OpenAI) -> None:
    """The text arrives in pieces, and it is about colours."""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    text = "".join(pieces).lower()
    assert len(pieces) >= 3, pieces  # streamed: 32 tokens in chunks of about 4 (shipped config)
    assert any(colour in text for colour in ("red", "blue", "green", "yellow")), text
    assert chunks[-1].choices[0].finish_reason in {"stop", "length"}


def test_readme_grpc_stream_is_the_http_completion(
    live_server: UserServer, client: openai.OpenAI
) -> None:
    with grpc.insecure_channel(live_server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            text="Paris is", sampling=pb.SamplingParameters(max_tokens=16, temperature=0)
        )
        streamed = "".join(
            choice.text
            for response in stub.Generate(request, timeout=120)
            for choice in response.choices
        )
    http = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=16, temperature=0)
    assert streamed.strip()
    assert streamed == http.choices[0].text


# --- chat ---------------------------------------------------------------------------------


def test_chat_answers_the_question_and_stops_by_itself(client: openai.OpenAI) -> None:
    response = _greedy_chat(client)
    (choice,) = response.choices
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop"  # the model ended its answer itself (EOS)
    assert response.model == MODEL
    assert 0 < response.usage.completion_tokens <= 24


def test_streamed_chat_is_the_same_answer(client: openai.OpenAI) -> None:
    whole = _greedy_chat(client).choices[0]
    stream = _greedy_chat(client, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert text == whole.message.content
    assert finish == [whole.finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


# --- tools, with no server flags --------------------------------------------------------------


def _single_weather_call(choice: Any) -> dict[str, Any]:
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1, choice.message
    (call,) = calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    assert choice.finish_reason == "tool_calls"
    return arguments


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_tool_choice_is_one_call_in_tool_calls(
    client: openai.OpenAI, tool_choice: Any
) -> None:
    """One question, one call: a named choice is one call by definition; `required` is one
    when parallel calls are off (with them on, SmolLM2 may repeat the call: the test below)."""
    response = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=TOOL_TOKENS,
    )
    arguments = _single_weather_call(response.choices[0])
    assert "paris" in arguments["city"].lower()


def test_required_with_parallel_calls_answers_in_tool_calls(client: openai.OpenAI) -> None:
    """OpenAI's default `parallel_tool_calls`: every call is a listed function with valid
    arguments and the first asks about Paris (the count is the model's: SmolLM2 may repeat it
    until `max_tokens`, which then ends the answer as "length" with the calls kept)."""
    response = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=TOOL_TOKENS,
    )
    (choice,) = response.choices
    calls = choice.message.tool_calls or []
    assert calls and choice.message.content is None
    assert choice.finish_reason in {"tool_calls", "length"}
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    for call in complete:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    assert "paris" in calls[0].function.arguments.lower()


def test_auto_tool_choice_needs_no_flag(client: openai.OpenAI) -> None:
    """`tool_choice: auto` (the default with tools) works on a server started with no tool
    flags: the answer is either text or calls the hermes parser read, never a refusal."""
    response = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice="auto",
        temperature=0,
        max_tokens=TOOL_TOKENS,
    )
    (choice,) = response.choices
    if choice.message.tool_calls:
        _single_weather_call(choice)
    else:
        assert (choice.message.content or "").strip()
        assert choice.finish_reason in {"stop", "length"}


def test_a_tool_result_is_answered_in_text(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=TOOL_TOKENS,
    )
    (call,) = first.choices[0].message.tool_calls or []
    messages = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    (choice,) = answer.choices
    assert not choice.message.tool_calls
    assert (choice.message.content or "").strip()


# --- structured output ------------------------------------------------------------------------


class Sky(pydantic.BaseModel):
    clear: bool
    color: Literal["blue", "grey"]


def test_parse_gives_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe the sky as JSON."}],
        response_format=Sky,
        temperature=0,
        max_tokens=TOOL_TOKENS,
    )
    (choice,) = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Sky)
    assert Sky.model_validate_json(choice.message.content or "") == choice.message.parsed


# --- LoRA by model name -------------------------------------------------------------------------


def test_an_adapter_is_picked_by_model_name(client: openai.OpenAI) -> None:
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {MODEL, "sql"}
    assert cards["sql"].model_dump()["parent"] == MODEL
    base = _greedy_chat(client)
    adapted = _greedy_chat(client, model="sql")
    assert adapted.model == "sql"
    assert adapted.choices[0].message.content
    assert adapted.choices[0].message.content != base.choices[0].message.content
    assert _greedy_chat(client, model="sql").choices[0].message.content == (
        adapted.choices[0].message.content
    )
    with pytest.raises(openai.NotFoundError) as refused:
        _greedy_chat(client, model="no-such-adapter")
    assert refused.value.code == "model_not_found"


# --- gRPC -----------------------------------------------------------------------------------------


def test_grpc_reports_the_served_model(live_server: UserServer) -> None:
    shipped = yaml.safe_load(shipped_serve_config().read_text())
    (app,) = shipped["applications"]
    with grpc.insecure_channel(live_server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        tokens = stub.Tokenize(pb.TokenizeRequest(text="Paris is"), timeout=30)
    assert info.max_model_len == app["args"]["engine"]["model"]["max_model_len"]
    assert info.architecture == "llama"
    assert len(tokens.token_ids) >= 2


# --- the stop: last, it ends the shared server ---------------------------------------------------


def test_sigterm_to_the_process_group_stops_it_cleanly(live_server: UserServer) -> None:
    shipped = yaml.safe_load(shipped_serve_config().read_text())
    grace_s = shipped["applications"][0]["args"]["shutdown"]["grace_s"]
    status, took = live_server.terminate(timeout_s=grace_s + 30)
    assert status == 0, f"exit status {status} after {took:.1f} s; log:\n{live_server.log_tail()}"
    assert took <= grace_s, f"took {took:.1f} s, past the {grace_s} s grace period"
    assert not answers(live_server.http_port) and not answers(live_server.grpc_port)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://localhost:{live_server.http_port}/health", timeout=5)
