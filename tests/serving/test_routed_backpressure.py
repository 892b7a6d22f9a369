"""A request Serve sheds because the engine deployment's queue is full (`BackPressureError`)
answers 503 with the wait the ingress's client predicts until the queue has room: its started
calls' measured ending rate (one more ending), 1 s before any rate is known. No Ray cluster:
a stand-in handle."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve.exceptions import BackPressureError

from cluster.engine.errors import EngineOverloaded
from cluster.engine.output_stream import RequestDelta
from cluster.engine.queue_wait import QueueWait
from cluster.serving.error_map import http_error
from cluster.serving.routed_engine import RoutedEngineClient


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


class Call:
    """One streamed call: one finished delta, or Serve's refusal."""

    def __init__(self, shed: bool) -> None:
        self.shed = shed
        self.sent = False

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> Any:
        if self.shed:
            raise BackPressureError(num_queued_requests=8, max_queued_requests=8)
        if self.sent:
            raise StopAsyncIteration
        self.sent = True
        return RequestDelta(request_id="r", branches=[], finished=True, num_cached_tokens=0)

    def cancel(self) -> None:
        pass


class Handle:
    """`handle.options(stream=True).generate.remote(...)`, shedding while `shed` is set."""

    def __init__(self) -> None:
        self.shed = False
        self.generate = self

    def options(self, **_: Any) -> Handle:
        return self

    def remote(self, *_: Any, **__: Any) -> Call:
        return Call(self.shed)


async def run(client: RoutedEngineClient) -> None:
    request: Any = SimpleNamespace(block_hashes=())  # all the client reads of a request
    async for _ in client.generate(request):
        pass


def test_a_shed_request_retries_after_the_predicted_room() -> None:
    clock = FakeClock()
    handle = Handle()
    client = RoutedEngineClient(handle, departures=QueueWait(window=8, clock=clock))

    async def scenario() -> None:
        handle.shed = True
        with pytest.raises(EngineOverloaded, match="queue is full") as cold:
            await run(client)
        assert cold.value.retry_after_s == 1.0  # no call has ended yet: no rate
        handle.shed = False
        for _ in range(4):  # a call ends every 3 s
            await run(client)
            clock.now += 3.0
        clock.now -= 3.0
        handle.shed = True
        with pytest.raises(EngineOverloaded) as warm:
            await run(client)
        assert warm.value.retry_after_s == pytest.approx(3.0)
        assert http_error(warm.value).headers == {"Retry-After": "3"}

    asyncio.run(scenario())
