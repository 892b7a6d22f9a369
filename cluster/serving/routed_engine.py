"""`RoutedEngineClient`: the `EngineClient` an ingress uses to reach the engine deployment.

Each request goes out through a Serve deployment handle with its prompt's block hashes as the
`block_hashes` keyword and the KV directory's answer for them (replica -> leading blocks held)
as `prefix_blocks`, so `PrefixAwareRouter` sends it to the replica that holds the longest prefix
(or, when overloaded, the least busy one); the outputs stream back through the handle.

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
- a LoRA adapter request's blocks are hashed with the adapter's weights digest exactly as the
  engines key them, taken from the adapter registry where every replica reported the same
  digest; without an agreed digest (just loaded, replicas disagree) it is routed by load only:
  routing never uses a key the engine would not use;
- `add_lora`, `remove_lora` and `list_loras` act on every engine replica at once, through the
  application's adapter registry (`AdapterService`), never on the one replica a handle picks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray import exceptions as ray_errors
from ray.serve.exceptions import BackPressureError

from cluster.engine.cache_keys import RequestKeys
from cluster.engine.errors import EngineDead, EngineOverloaded, RequestRejected
from cluster.engine.generate_request import GenerateRequest
from cluster.engine.lora_request import LoRARequest
from cluster.engine.output_stream import OutputAccumulator
from cluster.engine.outputs import RequestOutput
from cluster.serving.lora_admin import AdapterService
from cluster.serving.routing import BLOCK_HASHES_KWARG, PREFIX_BLOCKS_KWARG

CLIENT_ERRORS = (RequestRejected, EngineOverloaded, EngineDead)
Holdings = Callable[[list[bytes]], Awaitable[dict[str, int]]]
"""Which replicas hold how many leading blocks of a chain (the KV directory; never raises)."""


async def no_holdings(chain: list[bytes]) -> dict[str, int]:
    return {}


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

    def __init__(
        self,
        handle: Any,
        keys: RequestKeys,
        holdings: Holdings = no_holdings,
        queue_timeout_s: float | None = None,
        adapters: AdapterService | None = None,
    ) -> None:
        """`queue_timeout_s`: a request not started by then is refused as overloaded;
        `adapters`: the deployment's LoRA adapters (None: only the base model is served)."""
        self.handle = handle
        self.keys = keys
        self.holdings = holdings
        self.queue_timeout_s = queue_timeout_s
        self.adapters = adapters or AdapterService("", None)

    def routing_hashes(self, request: GenerateRequest) -> list[bytes]:
        """The block hashes the router reads (none for an adapter without an agreed digest, see
        the module doc). Raises RequestRejected for a bad shared prefix."""
        if request.adapter is not None:
            digests = self.adapters.view.digests
            if request.adapter not in digests:
                return []
            self.keys.adapters = dict(digests)  # the ingress's copy of the engines' map
        return self.keys.block_hashes(request)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        hashes = self.routing_hashes(request)
        held = await self.holdings(hashes)
        finished = False
        stream = None
        accumulator = OutputAccumulator()  # the replica streams deltas: O(new tokens) each
        try:
            # Inside the try: the router may refuse here already (BackPressureError).
            stream = self.handle.options(stream=True).generate.remote(
                request, **{BLOCK_HASHES_KWARG: hashes, PREFIX_BLOCKS_KWARG: held}
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
            finished = first.finished
            yield accumulator.apply(first)
            async for delta in stream:
                finished = delta.finished
                yield accumulator.apply(delta)
        except Exception as error:
            mapped = client_error(error)
            if mapped is None or mapped is error:
                raise
            raise mapped from None
        finally:
            if not finished and stream is not None:
                # `cancel` re-raises a call's routing failure (e.g. BackPressureError), which
                # would replace the client error raised above: the call is over either way.
                with contextlib.suppress(Exception):
                    stream.cancel()

    async def abort(self, request_id: str) -> None:
        """Requests are aborted by closing their `generate` stream (which cancels the call on
        the replica); there is nothing to do by id."""

    async def add_lora(self, lora: LoRARequest) -> None:
        await self.adapters.add_lora(lora)

    async def remove_lora(self, lora_name: str) -> None:
        await self.adapters.remove_lora(lora_name)

    async def list_loras(self) -> list[LoRARequest]:
        return await self.adapters.list_loras()
