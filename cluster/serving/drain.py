"""Graceful drain on shutdown: the `pagedserve serve` process and its ingress replicas agree on
when to stop taking work and when in-flight requests must end.

The runner publishes the phase and every ingress replica runs a `DrainGate`, which every
`POLL_PERIOD_S` reports how many requests it has in flight and learns the phase through its
`DrainReporter` (in a cluster, keys in Ray's GCS: cluster/serving/drain_board.py):

- `serving`: nothing changes;
- `draining` (the runner got SIGINT or SIGTERM): new requests are refused with
  `ServerDraining` (HTTP 503 with Retry-After in OpenAI's shape; gRPC RESOURCE_EXHAUSTED) and
  /health reports 503, while requests already admitted run on;
- `expired` (the grace period is over, or a second signal came): every request still running
  ends with `EngineDead` ("the server is shutting down"), which the front ends turn into an
  OpenAI error event followed by `[DONE]` (gRPC UNAVAILABLE), and its engine call is cancelled.

The runner waits until the ingresses report nothing in flight (or the grace period ends, then
expires the rest), and only then stops Serve and Ray: Serve's own shutdown stops the HTTP
proxies before replicas drain, which would cut open streams.

Invariants: a gate without a reporter (the app run by `serve run` or a test) never drains;
a request counts as in flight from its admission to the engines until its engine stream is
closed (the front end then only writes its last bytes; the runner allows `SETTLE_S` for them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol, TypeVar

from cluster.engine.background import cancel_and_wait
from cluster.engine.errors import EngineDead, EngineOverloaded

POLL_PERIOD_S = 0.2
SETTLE_S = 1.0
RETRY_AFTER_S = 5.0
"""What a refused client is told: another replica set (or this one, restarted) may take it."""

SHUTDOWN_MESSAGE = (
    "the server is shutting down: the request did not finish within the shutdown grace period"
)

Phase = Literal["serving", "draining", "expired"]
T = TypeVar("T")

log = logging.getLogger("pagedserve.drain")


class ServerDraining(EngineOverloaded):
    """The server is shutting down and takes no new requests (HTTP 503 with Retry-After)."""


class DrainReporter(Protocol):
    """How a gate reports its in-flight count and learns the phase to follow."""

    async def report(self, in_flight: int) -> Phase: ...

    async def close(self) -> None: ...


class DrainGate:
    """The ingress replica's side: admission, in-flight count, expiry (see the module doc).
    Without a reporter it never drains."""

    def __init__(self, reporter: DrainReporter | None) -> None:
        self._reporter = reporter
        self.phase: Phase = "serving"
        self.in_flight = 0
        self._expired = asyncio.Event()
        self._awaiting: set[asyncio.Task[Any]] = set()
        self._interrupted: set[asyncio.Task[Any]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._reporter is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._reporter is not None:
            with contextlib.suppress(Exception):  # the cluster may be going away
                await self._reporter.close()

    async def _watch(self) -> None:
        assert self._reporter is not None
        while True:
            try:
                self.set_phase(await self._reporter.report(self.in_flight))
            except Exception as error:  # the cluster is going away: nothing to coordinate
                log.debug("drain phase unreachable: %r", error)
            await asyncio.sleep(POLL_PERIOD_S)

    def set_phase(self, phase: Phase) -> None:
        if phase != self.phase:
            log.warning("drain: %s -> %s with %d in flight", self.phase, phase, self.in_flight)
        self.phase = phase
        if phase == "expired" and not self._expired.is_set():
            self._expired.set()
            for task in list(self._awaiting):  # each is suspended in `until_expired`'s await
                self._interrupted.add(task)
                task.cancel()

    @property
    def problem(self) -> str | None:
        """Why this replica should not get new work (for /health), or None."""
        return None if self.phase == "serving" else "the server is shutting down"

    def admit(self) -> None:
        """Raises ServerDraining once the server stopped taking new requests."""
        if self.phase != "serving":
            raise ServerDraining(
                "the server is shutting down and takes no new requests",
                retry_after_s=RETRY_AFTER_S,
            )

    async def until_expired(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        """`stream`, which ends with EngineDead once the drain expires; `stream` is closed
        however this ends (which cancels its engine call).

        No task per item: the reading task awaits `stream` directly and is registered while it
        does, so expiry cancels exactly the tasks suspended in that await (and this turns the
        cancel back into EngineDead); a reader between items sees the expiry at its next one."""
        try:
            while True:
                if self._expired.is_set():
                    raise EngineDead(SHUTDOWN_MESSAGE)
                task = asyncio.current_task()  # per item: another task may drive it next
                assert task is not None
                self._awaiting.add(task)
                try:
                    item = await anext(stream)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if task not in self._interrupted:
                        raise  # the reader's own cancellation (its client went away)
                    self._interrupted.discard(task)
                    task.uncancel()
                    raise EngineDead(SHUTDOWN_MESSAGE) from None
                finally:
                    self._awaiting.discard(task)
                yield item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]


class DrainingClient:
    """An `EngineClient` that refuses new requests while draining and ends running ones when
    the drain expires."""

    def __init__(self, inner: Any, gate: DrainGate) -> None:
        self.inner = inner
        self.gate = gate

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        """The inner stream, counted in flight from admission until it is closed."""
        gate = self.gate
        gate.admit()
        gate.in_flight += 1
        try:
            guarded = gate.until_expired(self.inner.generate(request))
            async with contextlib.aclosing(guarded):  # type: ignore[type-var]
                async for output in guarded:
                    yield output
        finally:
            gate.in_flight -= 1
