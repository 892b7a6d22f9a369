"""gRPC requests validated exactly as HTTP ones: a protobuf request becomes the same pydantic
request model the OpenAI routes parse (`CompletionRequest` for text and token ids,
`ChatCompletionRequest` for chat), so both front ends share one set of checks (roles, ranges,
finite numbers, stop-string count and lengths, n, logprobs, ...).

Invariants:
- every value HTTP refuses, gRPC refuses too, as INVALID_ARGUMENT carrying the same message;
- unset optional proto fields are left out, so they take the same defaults as an HTTP field
  left out (the model's generation defaults, else the engine's), except `max_tokens`, which is
  the model's `max_new_tokens` or else 16 for every prompt kind (the documented gRPC default);
- bytes that are not a valid message never reach a method as a message: the proxy's
  deserializer turns them into `CorruptRequest`, which `parse_or_abort` refuses;
- a request selects a LoRA adapter with `adapter` or, as over HTTP, with `model`; both set to
  different names is INVALID_ARGUMENT; the name is then resolved as HTTP resolves `model`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from pydantic import ValidationError

from cluster.engine.generate_request import PromptInput
from cluster.engine.generation_defaults import ENGINE_DEFAULTS, GenerationDefaults
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.openai_protocol import OpenAIError, error_from_validation
from cluster.serving.openai_requests import ChatCompletionRequest, CompletionRequest
from cluster.serving.tool_calls import ToolPlan, ToolSettings, render_options
from protos import generation_pb2 as pb

GRPC_DEFAULT_MAX_TOKENS = 16
ANY_MODEL = "(served model)"
"""The `model` put into the request model: gRPC checks the model name on its own."""

MessageT = TypeVar("MessageT")


class GrpcAbort(Exception):
    """Ends the call with `code` and `details` (the replica sets them on the gRPC context)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details

    def __reduce__(self) -> tuple[type[GrpcAbort], tuple[grpc.StatusCode, str]]:
        # Serve pickles the exception from the replica to its proxy.
        return (GrpcAbort, (self.code, self.details))


@dataclass(frozen=True)
class CorruptRequest:
    """What the proxy hands a method for bytes that do not parse as its request message."""

    message_type: str
    error: str


def parse_or_abort(request: MessageT | CorruptRequest) -> MessageT:
    """The request message, or `GrpcAbort` INVALID_ARGUMENT for corrupt bytes."""
    if isinstance(request, CorruptRequest):
        raise GrpcAbort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid {request.message_type} message: {request.error}",
        )
    return request


def requested_model(model: str, adapter: str, base_model: str) -> str:
    """The name to resolve for a request's `model` and `adapter` fields (empty: unset; both
    unset: the base model). Raises GrpcAbort INVALID_ARGUMENT when they name two models."""
    if adapter and model and model not in (adapter, base_model):
        raise GrpcAbort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"model {model!r} and adapter {adapter!r} name different models: set one",
        )
    return adapter or model or base_model


def invalid_argument(error: OpenAIError) -> Exception:
    return GrpcAbort(grpc.StatusCode.INVALID_ARGUMENT, error.message)


_OPTIONAL_SAMPLING_FIELDS = (
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "truncate_prompt_tokens",
    "prompt_logprobs",
)
"""`SamplingParameters` fields with presence that map one to one onto HTTP fields of that name."""


def sampling_fields(
    proto: pb.SamplingParameters, *, chat: bool, default_max_tokens: int
) -> dict[str, Any]:
    """The OpenAI request fields a `SamplingParameters` message sets (vLLM's extensions
    included), in the shape an HTTP body gives them, so one pydantic model checks both;
    `max_tokens` is `default_max_tokens` when unset."""
    fields: dict[str, Any] = {}
    for name in _OPTIONAL_SAMPLING_FIELDS:
        if proto.HasField(name):
            fields[name] = getattr(proto, name)
    fields.setdefault("max_tokens", default_max_tokens)
    if proto.stop:
        fields["stop"] = list(proto.stop)
    if proto.stop_token_ids:
        fields["stop_token_ids"] = list(proto.stop_token_ids)
    if proto.HasField("logprobs"):
        if chat:
            fields["logprobs"] = True
            fields["top_logprobs"] = proto.logprobs
        else:
            fields["logprobs"] = proto.logprobs
    fields["ignore_eos"] = proto.ignore_eos
    fields["include_stop_str_in_output"] = proto.include_stop_str_in_output
    if proto.allowed_token_ids:
        fields["allowed_token_ids"] = list(proto.allowed_token_ids)
    if proto.bad_words:
        fields["bad_words"] = list(proto.bad_words)
    if proto.logit_bias:
        # HTTP's shape: token ids as strings (OpenAI's JSON object keys).
        fields["logit_bias"] = {str(token): bias for token, bias in proto.logit_bias.items()}
    return fields


def structured_outputs_fields(request: pb.GenerateRequest) -> dict[str, Any]:
    """The HTTP `structured_outputs` field a request's `structured_outputs` message sets (none
    when unset), so both front ends validate it with the same code."""
    if not request.HasField("structured_outputs"):
        return {}
    proto = request.structured_outputs
    kind = proto.WhichOneof("constraint")
    if kind is None:
        raise GrpcAbort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "structured_outputs: set one of json, regex, choice, grammar or json_object",
        )
    value: Any = list(proto.choice.choices) if kind == "choice" else getattr(proto, kind)
    field = {kind: value, "disable_any_whitespace": proto.disable_any_whitespace}
    return {"structured_outputs": field}


def tool_fields(request: pb.GenerateRequest) -> dict[str, Any]:
    """The HTTP chat fields (`tools`, `tool_choice`, `parallel_tool_calls`) a request sets."""
    fields: dict[str, Any] = {}
    if request.tools:
        tools = []
        for index, tool in enumerate(request.tools):
            function: dict[str, Any] = {"name": tool.name}
            if tool.description:
                function["description"] = tool.description
            if tool.parameters_json:
                try:
                    function["parameters"] = json.loads(tool.parameters_json)
                except json.JSONDecodeError as error:
                    raise GrpcAbort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"tools[{index}].parameters_json is not valid JSON: {error}",
                    ) from None
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if choice == "mode":
        fields["tool_choice"] = request.tool_choice.mode
    elif choice == "function":
        name = request.tool_choice.function
        fields["tool_choice"] = {"type": "function", "function": {"name": name}}
    if request.HasField("parallel_tool_calls"):
        fields["parallel_tool_calls"] = request.parallel_tool_calls
    return fields


def template_kwargs_fields(request: pb.GenerateRequest) -> dict[str, Any]:
    """HTTP's `chat_template_kwargs` from `chat_template_kwargs_json` (none when empty)."""
    if not request.chat_template_kwargs_json:
        return {}
    try:
        kwargs = json.loads(request.chat_template_kwargs_json)
    except json.JSONDecodeError as error:
        raise GrpcAbort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"chat_template_kwargs_json is not valid JSON: {error}",
        ) from None
    return {"chat_template_kwargs": kwargs}


def chat_request(chat: pb.ChatMessages, fields: dict[str, Any]) -> ChatCompletionRequest:
    """Chat messages (and sampling `fields`) as a validated `ChatCompletionRequest`."""
    messages = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return _validated(ChatCompletionRequest, {**fields, "messages": messages})


RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)


def _validated(model: type[RequestT], fields: dict[str, Any]) -> RequestT:
    try:
        request = model.model_validate({"model": ANY_MODEL, **fields})
        request.check_supported()
    except ValidationError as error:
        raise invalid_argument(error_from_validation(error)) from None
    except OpenAIError as error:
        raise invalid_argument(error) from None
    return request


@dataclass(frozen=True)
class ValidatedGenerate:
    """A `GenerateRequest` after the HTTP checks: the prompt, the engine's parameters, the tool
    plan (None: no tools), how to render the chat (`chat_template`, `tools`) and the
    scheduling priority."""

    prompt: PromptInput
    params: SamplingParams
    tools: ToolPlan | None = None
    render: dict[str, Any] = field(default_factory=dict)
    priority: int = 0


def validated_generate(
    request: pb.GenerateRequest, defaults: GenerationDefaults = ENGINE_DEFAULTS
) -> tuple[PromptInput, SamplingParams]:
    """The prompt and sampling parameters of a `GenerateRequest` (see `validate_generate`),
    unset fields taking `defaults` (default: the engine's own)."""
    checked = validate_generate(request, ToolSettings(), model_template=None, defaults=defaults)
    return checked.prompt, checked.params


def validate_generate(
    request: pb.GenerateRequest,
    tool_settings: ToolSettings,
    model_template: str | None,
    *,
    defaults: GenerationDefaults,
) -> ValidatedGenerate:
    """The request after the HTTP checks; raises GrpcAbort INVALID_ARGUMENT for anything HTTP
    would refuse with 400. Tools take a chat prompt and are planned as HTTP plans them
    (`tool_settings`: the server's flags; `model_template`: the model's chat template); unset
    sampling fields take the model's generation `defaults`, as over HTTP."""
    kind = request.WhichOneof("prompt")
    fields = sampling_fields(
        request.sampling,
        chat=kind == "chat",
        default_max_tokens=defaults.max_tokens_or(None, GRPC_DEFAULT_MAX_TOKENS),
    )
    fields["priority"] = request.priority
    fields.update(structured_outputs_fields(request))
    extra = tool_fields(request) | template_kwargs_fields(request)
    if extra and kind != "chat":
        raise GrpcAbort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{', '.join(extra)} need a chat prompt (prompt.chat)",
        )
    fields.update(extra)
    prompt: PromptInput
    parsed: CompletionRequest | ChatCompletionRequest
    if kind == "text":
        parsed = _validated(CompletionRequest, {**fields, "prompt": request.text})
        prompt = request.text
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        parsed = _validated(CompletionRequest, {**fields, "prompt": ids})
        prompt = {"prompt_token_ids": ids}
    elif kind == "chat":
        parsed = chat_request(request.chat, fields)
        prompt = parsed.chat_messages()
    else:
        raise GrpcAbort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "set one of prompt.text, prompt.token_ids, prompt.chat",
        )
    plan = None
    render: dict[str, Any] = {}
    if isinstance(parsed, ChatCompletionRequest):
        try:
            plan = parsed.tool_plan(tool_settings)
        except OpenAIError as error:
            raise invalid_argument(error) from None
        render = render_options(plan, parsed.messages, model_template)
        if parsed.chat_template_kwargs:
            render["chat_template_kwargs"] = parsed.chat_template_kwargs
    try:
        kwargs = parsed.sampling_kwargs(defaults)
    except OpenAIError as error:  # a default token limit below min_tokens
        raise invalid_argument(error) from None
    constraint = None if plan is None else plan.constraint()
    if constraint is not None:
        kwargs["structured_outputs"] = constraint
    try:
        params = SamplingParams(**kwargs)
    except ValueError as error:
        raise GrpcAbort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {error}") from None
    return ValidatedGenerate(prompt, params, plan, render, parsed.priority)
