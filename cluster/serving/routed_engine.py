"""`RoutedEngineClient`: the `EngineClient` an ingress uses to reach the engine deployment.

Each request goes out through a Serve deployment handle with its prompt's block hashes as the
`block_hashes` keyword, so `PrefixAwareRouter` sends it to the replica that holds the longest
prefix (or, when overloaded, the least busy one); the outputs stream back through the handle.

Invariants:
- what a replica raises for the client (RequestRejected, EngineOverloaded, EngineDead) comes
  out as that same exception with its own message, never as Ray's wrapper with a traceback;
- a replica that dies mid-request, or a deployment that sheds the request (its queue is full),
  ends the stream with EngineDead / EngineOverloaded, which the front ends turn into an error
  the client can read (an SSE error event, a 503, UNAVAILABLE);
- closing the stream before it finished cancels the call on the replica, which aborts the
  request there and frees its blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray import exceptions as ray_errors
from ray.serve.exceptions import BackPressureError

from cluster.engine.cache_keys import RequestKeys
from cluster.engine.errors import EngineDead, EngineOverloaded, RequestRejected
from cluster.engine.generate_request import GenerateRequest
from cluster.engine.output_stream import OutputAccumulator
from cluster.engine.outputs import RequestOutput
from cluster.serving.routing import BLOCK_HASHES_KWARG

CLIENT_ERRORS = (RequestRejected, EngineOverloaded, EngineDead)


def client_error(error: BaseException) -> Exception | None:
    """The client-facing error for what a handle call raised, or None when it is not one."""
    if isinstance(error, BackPressureError):
        return EngineOverloaded(f"every engine replica's queue is full: {error}")
    if isinstance(error, ray_errors.RayTaskError):
        cause = error.cause
        if isinstance(cause, CLIENT_ERRORS):
            return cause
        if isinstance(cause, ValueError):
            return RequestRejected(str(cause))
        return EngineDead(f"the engine replica failed: {type(cause).__name__}: {cause}")
    if isinstance(error, ray_errors.RayActorError | ray_errors.ActorUnavailableError):
        return EngineDead(f"the engine replica serving this request died: {error}")
    if isinstance(error, CLIENT_ERRORS):
        return error
    return None


class RoutedEngineClient:
    """Streams `GenerateRequest`s through the engine deployment's handle (see the module doc)."""

    def __init__(self, handle: Any, keys: RequestKeys) -> None:
        self.handle = handle
        self.keys = keys

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        hashes = self.keys.block_hashes(request)  # RequestRejected for a bad shared prefix
        stream = self.handle.options(stream=True).generate.remote(
            request, **{BLOCK_HASHES_KWARG: hashes}
        )
        finished = False
        accumulator = OutputAccumulator()  # the replica streams deltas: O(new tokens) each
        try:
            async for delta in stream:
                finished = delta.finished
                yield accumulator.apply(delta)
        except Exception as error:
            mapped = client_error(error)
            if mapped is None or mapped is error:
                raise
            raise mapped from None
        finally:
            if not finished:
                stream.cancel()

    async def abort(self, request_id: str) -> None:
        """Requests are aborted by closing their `generate` stream (which cancels the call on
        the replica); there is nothing to do by id."""
