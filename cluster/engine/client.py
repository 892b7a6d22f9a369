"""`EngineClient`: what the front ends (OpenAI HTTP, gRPC, handle callers) need of an engine;
`EngineHealth`, the step loop's health snapshot; `ModelInfo`, what the engine serves.

The in-process `AsyncEngine` implements it; so can anything that forwards to engines elsewhere
(a routed client over Serve deployment handles) or a test double. Front ends are typed on this
protocol, never on a concrete engine.

Invariants every implementation keeps:
- `generate` raises RequestRejected / EngineOverloaded / EngineDead before its first delta when
  the request cannot run; every stream it returns ends with a delta whose `finished` is True,
  or raises; closing the stream early aborts the request and frees its blocks;
- adapters are loaded through the application's registry (`AdapterService`), never through
  one client;
- an engine's metrics and health are the deployment's business (the engine replica reports
  them to Serve and to the ingress), not the client's.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from cluster.engine.generate_request import GenerateRequest
from cluster.engine.output_stream import RequestDelta
from workers import ModelInfo

__all__ = ["EngineClient", "EngineHealth", "ModelInfo"]


@dataclass(frozen=True)
class EngineHealth:
    """A snapshot of the step loop's health.

    `alive` is False once the loop failed or the engine was shut down (`error` says which);
    `last_step_finished_s` is `time.monotonic()` when the last step finished (None before the
    first); `num_unfinished` counts requests waiting, running or swapped.
    """

    alive: bool
    error: str | None
    last_step_finished_s: float | None
    num_unfinished: int


class EngineClient(Protocol):
    """An engine as a front end sees it."""

    def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestDelta, None]:
        """Streams the request's deltas (see `output_stream`) until it finishes."""
        ...
