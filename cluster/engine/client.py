"""`EngineClient`: what the front ends (OpenAI HTTP, gRPC, handle callers) need of an engine.

The in-process `AsyncEngine` implements it; so can anything that forwards to engines elsewhere
(a routed client over Serve deployment handles) or a test double. Front ends are typed on this
protocol, never on a concrete engine.

Invariants every implementation keeps:
- `generate` raises RequestRejected / EngineOverloaded / EngineDead before its first output when
  the request cannot run; every stream it returns ends with an output whose `finished` is True,
  or raises; closing the stream early aborts the request and frees its blocks;
- `metrics()` and `health()` are snapshots that never block on the engine's step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from cluster.engine.generate_request import GenerateRequest
from cluster.engine.metrics import EngineMetrics
from cluster.engine.outputs import RequestOutput
from workers import ModelInfo


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

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (deltas since the previous one) until it finishes."""
        ...

    async def abort(self, request_id: str) -> None:
        """Frees every block of the request (now, or right after the step in flight)."""
        ...

    def metrics(self) -> EngineMetrics: ...

    def health(self) -> EngineHealth: ...

    def model_info(self) -> ModelInfo: ...
