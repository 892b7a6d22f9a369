"""One map from the errors a request can meet to what every front end answers: the HTTP status
with OpenAI's error body, and the gRPC status code.

The first class in `ANSWERS` the error is an instance of decides (subclasses come first). An
error that is none of them is a bug of the server, never a client's answer: it propagates (HTTP
500, gRPC INTERNAL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from cluster.engine.errors import (
    AdapterNotFound,
    EngineDead,
    EngineOverloaded,
    PriorityNotEnabled,
    RequestRejected,
)
from cluster.serving.frontend import ContextOverflow
from cluster.serving.grpc_validation import GrpcAbort
from cluster.serving.openai_protocol import OpenAIError
from cluster.serving.tenancy import Forbidden, Unauthenticated


@dataclass(frozen=True)
class Answer:
    """What one kind of error is answered with on each front end."""

    http_status: int
    grpc_code: grpc.StatusCode
    error_type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    """The OpenAI body's `param` for this kind (None: the field the request was refused on)."""


S = grpc.StatusCode
ANSWERS: tuple[tuple[type[Exception], Answer], ...] = (
    (Unauthenticated, Answer(401, S.UNAUTHENTICATED, "authentication_error", "invalid_api_key")),
    (Forbidden, Answer(403, S.PERMISSION_DENIED, "permission_error", "forbidden")),
    (AdapterNotFound, Answer(404, S.NOT_FOUND, "NotFoundError", "model_not_found", "model")),
    (ContextOverflow, Answer(400, S.INVALID_ARGUMENT, code="context_length_exceeded")),
    (PriorityNotEnabled, Answer(400, S.INVALID_ARGUMENT, param="priority")),
    (RequestRejected, Answer(400, S.INVALID_ARGUMENT)),
    (EngineOverloaded, Answer(503, S.RESOURCE_EXHAUSTED, "server_error", "engine_overloaded")),
    (EngineDead, Answer(503, S.UNAVAILABLE, "server_error", "engine_unavailable")),
)  # fmt: skip
ANSWERED = tuple(kind for kind, _ in ANSWERS)
"""The errors a front end answers (catch these; anything else is the server's bug)."""


def answer_for(error: BaseException) -> Answer | None:
    for kind, answer in ANSWERS:
        if isinstance(error, kind):
            return answer
    return None


def http_error(error: Exception, param: str | None = None) -> OpenAIError:
    """The OpenAI error for `error` (one of `ANSWERED`); `param` names the request's field a
    refusal of its input is about (the prompt or the messages)."""
    answer = answer_for(error)
    if answer is None:
        raise TypeError(f"{type(error).__name__} is not a client's answer") from error
    headers = None
    retry_after_s = _retry_after_s(error)
    if retry_after_s is not None:
        headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    is_input = answer.http_status == 400
    return OpenAIError(
        answer.http_status,
        str(error),
        error_type=answer.error_type,
        param=answer.param or (param if is_input else None),
        code=answer.code,
        headers=headers,
    )


def grpc_abort(error: Exception) -> GrpcAbort:
    """The gRPC status for `error` (one of `ANSWERED`)."""
    answer = answer_for(error)
    if answer is None:
        raise TypeError(f"{type(error).__name__} is not a client's answer") from error
    details = str(error)
    retry_after_s = _retry_after_s(error)
    if retry_after_s is not None:
        details = f"{error}; retry after {retry_after_s:g} s"
    return GrpcAbort(answer.grpc_code, details)


def _retry_after_s(error: Exception) -> float | None:
    """When a refused request may be sent again: every 503 carries the wait its error predicts
    (`retry_after_s`), so a client always has something to act on."""
    retry_after_s = getattr(error, "retry_after_s", None)
    return float(retry_after_s) if isinstance(retry_after_s, int | float) else None
