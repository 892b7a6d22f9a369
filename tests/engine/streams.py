"""Test views of an `AsyncEngine`: its delta stream read as cumulative outputs, a request's
block-hash chain and the hashes its block manager holds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from cluster.engine.generate_request import GenerateRequest
from cluster.engine.output_stream import OutputAccumulator
from cluster.engine.outputs import RequestOutput


async def engine_outputs(
    engine: Any, request: GenerateRequest, stream_interval: int = 1
) -> AsyncIterator[RequestOutput]:
    """`engine.generate(request)` folded into cumulative `RequestOutput`s; closing this stream
    closes the engine's (which aborts an unfinished request)."""
    accumulator = OutputAccumulator()
    stream = engine.generate(request, stream_interval)
    try:
        async for delta in stream:
            yield accumulator.apply(delta)
    finally:
        await stream.aclose()


def block_hashes(engine: Any, request: GenerateRequest) -> list[bytes]:
    """The chain of the request's blocks a prefix lookup could hit, as the engine keys them."""
    return list(engine.core.request_keys.block_hashes(request))


def cached_block_hashes(engine: Any) -> list[bytes]:
    """Every hash the engine holds cached on the device now."""
    return list(engine.core.block_manager.cached_block_hashes())
