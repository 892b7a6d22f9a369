"""The OpenAI-compatible HTTP protocol at the edge: errors, body parsing, response models, SSE.

Pydantic lives here and nowhere deeper. Request models are in `openai_requests`; a body is
decoded and validated by `parse_object`, and engine outputs go back out as the response or
stream-chunk models here.

Invariants:
- Bad input never becomes a 500: malformed JSON, a wrong type, an out-of-range value or an
  unsupported feature all raise `OpenAIError` with status 400 and OpenAI's error body
  (`{"error": {"message", "type", "param", "code"}}`), naming the offending parameter.
"""

from __future__ import annotations

import json
import re
from typing import Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError

from cluster.serving.tool_calls import ToolCallOut


class OpenAIError(Exception):
    """An error the HTTP layer returns as OpenAI's error body with `status` and `headers`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorBody(
                message=self.message, type=self.error_type, param=self.param, code=self.code
            )
        )


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """400: the request is malformed or asks for something this server cannot do."""
    return OpenAIError(400, message, param=param, code=code)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


_TYPE_TAG = re.compile(r"^[A-Z]|[\[\]-]|^(str|int|float|bool|none|list|dict)$")
"""Union-member tags pydantic puts into error locations (`'list[int]'`, `'ChatMessage'`)."""


def _param_of(loc: tuple[int | str, ...]) -> str:
    """`('messages', 1, 'content', 'str')` -> `'messages[1].content'`."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _TYPE_TAG.search(part):
            param += f".{part}" if param else part
    return param


def error_from_validation(exc: ValidationError) -> OpenAIError:
    """Map pydantic's errors to one 400 naming the first offending parameter."""
    errors = exc.errors(include_url=False)
    param = _param_of(errors[0]["loc"])
    messages = list(dict.fromkeys(e["msg"] for e in errors if _param_of(e["loc"]) == param))
    detail = messages[0] if len(messages) == 1 else "; ".join(messages[:4])
    return invalid_request(f"Invalid value for '{param}': {detail}", param=param)


BodyT = TypeVar("BodyT", bound=BaseModel)


def parse_object(body: bytes, model: type[BodyT]) -> BodyT:
    """Parse a raw JSON object body into `model`; every failure is a 400 naming the field."""
    try:
        decoded = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid_request(f"Request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid_request("Request body is not valid JSON: it nests too deep") from None
    if not isinstance(decoded, dict):
        raise invalid_request("Request body must be a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise error_from_validation(exc) from None


FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class PromptTokenLogprob(BaseModel):
    """vLLM's `Logprob` in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]
"""vLLM's `prompt_logprobs`: None for the first prompt token, then token id -> logprob."""


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or (with `object` unchanged, as OpenAI does) one stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    """vLLM's: the thinking span, with `--reasoning-parser` (left out when there is none)."""
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One served model, as vLLM lists them: the base model (`root` the model it was loaded
    from, `parent` None) or a LoRA adapter (`root` its path, `parent` the base model's id);
    `max_model_len` is the context a request may fill; `architecture` (ours, not vLLM's) the
    model family that runs it (e.g. `llama`, `qwen3_moe`)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    architecture: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


SSE_DONE = "data: [DONE]\n\n"
"""The sentinel that ends every stream."""


def sse_event(payload: BaseModel) -> str:
    """One server-sent event carrying `payload` as JSON (unset optionals are left out)."""
    return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"
