"""`EngineClient`: what the front ends (OpenAI HTTP, gRPC, handle callers) need of an engine;
`EngineHealth`, the step loop's health snapshot; `ModelInfo`, what the engine serves.

The in-process `AsyncEngine` implements it; so can anything that forwards to engines elsewhere
(a routed client over Serve deployment handles) or a test double. Front ends are typed on this
protocol, never on a concrete engine.

Invariants every implementation keeps:
- `generate` raises RequestRejected / EngineOverloaded / EngineDead before its first output when
  the request cannot run; every stream it returns ends with an output whose `finished` is True,
  or raises; closing the stream early aborts the request and frees its blocks;
- an engine's metrics and health are the deployment's business (the engine replica reports
  them to Serve and to the ingress), not the client's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from cluster.engine.generate_request import GenerateRequest
from cluster.engine.lora_request import LoRARequest
from cluster.engine.outputs import RequestOutput
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

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (deltas since the previous one) until it finishes."""
        ...

    async def abort(self, request_id: str) -> None:
        """Frees every block of the request (now, or right after the step in flight)."""
        ...

    async def add_lora(self, lora: LoRARequest) -> None:
        """Loads the adapter (PEFT format) and serves it under `lora.lora_name`; loading the same
        name again with the same path is a no-op. Raises InvalidAdapter (nothing already loaded
        is affected) or RequestRejected when LoRA is not enabled."""
        ...

    async def remove_lora(self, lora_name: str) -> None:
        """Stops serving the adapter; requests already running with it finish. Raises
        AdapterNotFound for a name that is not loaded."""
        ...

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters served now, in load order."""
        ...
