"""Errors the engine raises to its callers (the serving layer maps them to HTTP/gRPC statuses)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class RequestRejected(Exception):
    """The request can never be served as asked: too long for the model's context or larger than
    the whole KV pool, or invalid input. Maps to HTTP 400; retrying the same request cannot help."""


class AdapterNotFound(RequestRejected):
    """The request names a LoRA adapter the engine does not serve. Maps to HTTP 404
    (`model_not_found`) / gRPC NOT_FOUND."""


class InvalidAdapter(RequestRejected):
    """A LoRA adapter cannot be loaded as given: missing or malformed files, a rank above
    `lora.max_lora_rank`, target modules or shapes that do not fit the base model. The message
    names the problem. Maps to HTTP 400 / gRPC INVALID_ARGUMENT; adapters already loaded are not
    affected."""


class PriorityNotEnabled(RequestRejected):
    """A request asks for a non-zero `priority` of an engine that schedules `fcfs`. Maps to HTTP
    400 with `param: "priority"` / gRPC INVALID_ARGUMENT."""


class EngineOverloaded(Exception):
    """The admission queue is full right now. Maps to HTTP 429/503 with Retry-After."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[object, ...]:
        # Crosses process boundaries (Serve handles) with its retry hint intact.
        return (_overloaded, (str(self), self.retry_after_s))


def _overloaded(message: str, retry_after_s: float) -> EngineOverloaded:
    return EngineOverloaded(message, retry_after_s=retry_after_s)


class EngineDead(RuntimeError):
    """The engine's step loop stopped after an internal error; no request can make progress.
    Answered with 503 and Retry-After: another replica, or the one Serve starts in its place,
    can take the retry (`retry_after_s`)."""

    def __init__(self, message: str = "", *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[object, ...]:
        # Crosses process boundaries (Serve handles) as its own class with its retry hint.
        return (_dead, (type(self), str(self), self.retry_after_s))


def _dead(kind: type[EngineDead], message: str, retry_after_s: float) -> EngineDead:
    return kind(message, retry_after_s=retry_after_s)


class RequestFailed(EngineDead):
    """The step running this request failed in a way attributable to that step's requests (the
    workers refused its plan, or a token of this request could not be applied); the engine kept
    serving every other request. A server-side failure, not the caller's input: it maps like
    EngineDead (HTTP 503, gRPC UNAVAILABLE), and a retry can succeed."""


class ConfigError(ValueError):
    """An invalid configuration; the message names the offending field (e.g. `cache.block_size`)."""


_UNION_MEMBER = re.compile(r"(int|float|str|bool|none|constrained-\w+|literal\[.*\])")
"""The location part pydantic adds for each member of a union field (`int | Literal["auto"]`)."""


def describe_validation_error(error: ValidationError) -> str:
    """One `section.field: message` per field, "; "-joined, a union field's members' messages
    joined by "or" (`scheduler.max_num_seqs: Input should be a valid integer, ... or Input
    should be 'auto'`) and validators' "Value error, " prefix dropped."""
    problems: dict[str, list[str]] = {}
    for item in error.errors():
        parts = [str(part) for part in item["loc"]]
        if len(parts) > 1 and _UNION_MEMBER.fullmatch(parts[-1]):
            parts = parts[:-1]
        message = item["msg"].removeprefix("Value error, ")
        problems.setdefault(".".join(parts), []).append(message)
    return "; ".join(
        f"{location}: {' or '.join(messages)}" if location else " or ".join(messages)
        for location, messages in problems.items()
    )
