"""What the serving edge refuses before doing work: the `limits` section of the app's args, and
reading an HTTP body under its size limit.

Invariants:
- a body larger than `max_body_bytes` is refused with 413 in OpenAI's error shape before any of
  it is parsed: at once when `Content-Length` says so (nothing is read), otherwise as soon as
  the bytes read so far pass the limit (never more than one chunk past it is held);
- a request that has produced no output within `queue_timeout_s` (when set) of being sent to
  the engines (queued at a handle or in an engine's admission queue) is shed with 503 and
  Retry-After, and its call is cancelled (which frees anything it held). Unset by default: a
  burst queues, and an engine refuses at admission only what its measured drain rate predicts
  it cannot start within `scheduler.max_queue_wait_s`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import ClientDisconnect, Request

from cluster.serving.openai_protocol import OpenAIError, invalid_request

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""4 MiB: far more than a prompt the default model's context can hold (2048 tokens)."""

MetricsAccess = Literal["open", "api_key", "port"]


class MetricsArgs(BaseModel):
    """Who may read `/metrics`: `open` (anyone), `api_key` (a configured API key is required,
    as for the API; open when no keys are configured) or `port` (only on `port`, a separate
    listener of each ingress replica, e.g. reachable from the cluster network only)."""

    model_config = ConfigDict(extra="forbid")

    access: MetricsAccess = "open"
    port: int | None = Field(None, ge=1, le=65535, description="the metrics port (access: port)")

    @model_validator(mode="after")
    def _port_when_needed(self) -> MetricsArgs:
        if (self.access == "port") != (self.port is not None):
            raise ValueError("metrics.port is required with access 'port' and only then")
        return self


class LimitsArgs(BaseModel):
    """Limits the ingress enforces before a request costs the engines anything."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES, ge=1024, description="largest HTTP request body (413 beyond)"
    )
    queue_timeout_s: float | None = Field(
        None,
        gt=0,
        description="longest a request may wait for its first output (503 with Retry-After); "
        "unset: no limit by the clock here (the engines refuse by predicted wait instead, "
        "scheduler.max_queue_wait_s)",
    )
    metrics: MetricsArgs = Field(default_factory=MetricsArgs)


def body_too_large(max_body_bytes: int, seen: int | None = None) -> OpenAIError:
    """413 in OpenAI's error shape."""
    got = f" (at least {seen} bytes)" if seen is not None else ""
    return OpenAIError(
        413,
        f"Request body too large{got}: this server accepts at most {max_body_bytes} bytes",
        code="request_too_large",
    )


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The request's body, or OpenAIError 413 once it is known to exceed `max_body_bytes`
    (from `Content-Length` before reading, else while reading), 400 for a bad Content-Length."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise invalid_request("Content-Length is not an integer") from None
        if length > max_body_bytes:
            raise body_too_large(max_body_bytes, length)
    chunks: list[bytes] = []
    seen = 0
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > max_body_bytes:
                raise body_too_large(max_body_bytes, seen)
            chunks.append(chunk)
    except ClientDisconnect:
        raise invalid_request("the client disconnected while sending the body") from None
    return b"".join(chunks)
