"""`RoutedEngineClient`: the `EngineClient` an ingress uses to reach the engine deployment.

Each request goes out through a Serve deployment handle carrying its prompt's block hashes
(hashed once, when the front end prepared it: `GenerateRequest.block_hashes`), with the KV
directory's answer for them (replica -> leading blocks held) as the `prefix_blocks` keyword, so
`PrefixAwareRouter` sends it to the replica that holds the longest prefix (or, when overloaded,
the least busy one); the deltas stream back through the handle as they are.

Invariants:
- what a replica raises for the client (RequestRejected, EngineOverloaded, EngineDead) comes
  out as that same exception with its own message, never as Ray's wrapper with a traceback;
- a replica that dies mid-request, or a deployment that sheds the request (its queue is full),
  ends the stream with EngineDead / EngineOverloaded, which the front ends turn into an error
  the client can read (an SSE error event, a 503, UNAVAILABLE);
- closing the stream before it finished cancels the call on the replica, which aborts the
  request there and frees its blocks;
- a request with no output `queue_timeout_s` after it was sent (queued at the handle or in an
  engine's admission queue) is cancelled and ends with EngineOverloaded (503 + Retry-After);
- a request Serve sheds because the deployment's queue is full gets the wait this client
  predicts until the queue has room as its Retry-After: one more of its calls ending, by the
  rate at which its calls have been ending (`QueueWait`; 1 s while it knows no rate);
- a request without hashes (an adapter without an agreed digest, see `FrontEnd.routing_hashes`)
  is routed by load only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from ray import exceptions as ray_errors
from ray.serve.exceptions import BackPressureError

from cluster.engine.errors import EngineDead, EngineOverloaded, RequestRejected
from cluster.engine.generate_request import GenerateRequest
from cluster.engine.output_stream import RequestDelta
from cluster.engine.queue_wait import QueueWait
from cluster.serving.routing import PREFIX_BLOCKS_KWARG

REPLICA_ERRORS = (RequestRejected, EngineOverloaded, EngineDead)
"""What a replica raises for the client: it comes out of the handle as itself."""
Holdings = Callable[[list[bytes]], Awaitable[dict[str, int]]]
"""Which replicas hold how many leading blocks of a chain (the KV directory; never raises)."""


async def no_holdings(chain: list[bytes]) -> dict[str, int]:
    return {}


def client_error(error: BaseException, queue_wait_s: float | None = None) -> Exception | None:
    """The client-facing error for what a handle call raised, or None when it is not one;
    `queue_wait_s`: the predicted wait until a full deployment queue has room (None: unknown,
    1 s)."""
    if isinstance(error, BackPressureError):
        return EngineOverloaded(
            f"every engine replica's queue is full: {error}",
            retry_after_s=1.0 if queue_wait_s is None else queue_wait_s,
        )
    if isinstance(error, ray_errors.RayTaskError):
        cause = error.cause
        if isinstance(cause, REPLICA_ERRORS):
            return cause
        return EngineDead(f"the engine replica failed: {type(cause).__name__}: {cause}")
    if isinstance(error, ray_errors.RayActorError | ray_errors.ActorUnavailableError):
        return EngineDead(f"the engine replica serving this request died: {error}")
    if isinstance(error, REPLICA_ERRORS):
        return error
    return None


class RoutedEngineClient:
    """Streams `GenerateRequest`s through the engine deployment's handle (see the module doc)."""

    def __init__(
        self,
        handle: Any,
        holdings: Holdings = no_holdings,
        queue_timeout_s: float | None = None,
        departures: QueueWait | None = None,
    ) -> None:
        """`queue_timeout_s`: a request not started by then is refused as overloaded.
        `departures`: when this client's started calls ended (a fresh one by default), which
        predicts a full queue's Retry-After."""
        self.handle = handle
        self.holdings = holdings
        self.queue_timeout_s = queue_timeout_s
        self.departures = departures if departures is not None else QueueWait()

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestDelta, None]:
        held = await self.holdings(list(request.block_hashes))
        finished = started = False
        stream = None
        try:
            # Inside the try: the router may refuse here already (BackPressureError).
            stream = self.handle.options(stream=True).generate.remote(
                request, **{PREFIX_BLOCKS_KWARG: held}
            )
            try:
                async with asyncio.timeout(self.queue_timeout_s):
                    first = await anext(stream)
            except TimeoutError:
                raise EngineOverloaded(
                    f"the request waited {self.queue_timeout_s:g} s without being started "
                    "(queue timeout)",
                    retry_after_s=max(1.0, self.queue_timeout_s / 10),
                ) from None
            except StopAsyncIteration:
                return
            started = True
            finished = first.finished
            yield first
            async for delta in stream:
                finished = delta.finished
                yield delta
        except Exception as error:
            mapped = client_error(error, self.departures.predict(0))
            if mapped is None or mapped is error:
                raise
            raise mapped from None
        finally:
            if started:  # a call that held a replica's slot ended: the queue moves on
                self.departures.observe_departure()
            if not finished and stream is not None:
                # `cancel` re-raises a call's routing failure (e.g. BackPressureError), which
                # would replace the client error raised above: the call is over either way.
                with contextlib.suppress(Exception):
                    stream.cancel()
