"""Engine delta streams as every API reads them (chat and completions, Responses, Messages):
several streams merged in arrival order, their usage summed, a branch's finish as OpenAI names
it.

Invariant: closing a merged stream, or an error in any of its inputs, closes every input
(which aborts their requests and frees their blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from cluster.engine.output_stream import BranchDelta, RequestDelta
from cluster.engine.outputs import CompletionOutput, RequestOutput
from cluster.serving.frontend import DeltaStream, StreamTally
from cluster.serving.openai_protocol import FinishReason, Usage


@dataclass
class _End:
    error: Exception | None = None


async def merge_streams(
    streams: Sequence[DeltaStream],
) -> AsyncGenerator[tuple[int, RequestDelta]]:
    """Interleaves streams as `(stream index, delta)` in arrival order (one stream is read as
    it is, without a task). Closing the merged stream, or an error in any input, closes every
    input (which aborts their requests)."""
    if len(streams) == 1:
        (stream,) = streams
        try:
            async for item in stream:
                yield 0, item
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | _End]] = asyncio.Queue()

    async def pump(index: int, stream: DeltaStream) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, _End()))
        except Exception as error:
            await queue.put((index, _End(error)))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if not isinstance(item, _End):
                yield index, item
            elif item.error is not None:
                raise item.error
            else:
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(tallies: Sequence[StreamTally]) -> Usage:
    return Usage.of(
        prompt_tokens=sum(t.prompt_tokens for t in tallies),
        completion_tokens=sum(t.completion_tokens for t in tallies),
        cached_tokens=sum(t.cached_tokens for t in tallies),
    )


def finish_reason(output: CompletionOutput | BranchDelta) -> FinishReason | None:
    if output.finish_reason is None:
        return None
    return "length" if output.finish_reason == "length" else "stop"


def whole_usage(finals: Sequence[RequestOutput]) -> Usage:
    usages = [final.usage for final in finals]
    return Usage.of(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in usages),
    )
