"""`RankThread`: the one thread that makes every torch call of an in-process rank.

Why one thread: torch's CPU parallelism is OpenMP (libgomp), which gives every thread that opens
a parallel region a team of worker threads of its own. When the steps of one rank come from
whichever thread of a pool is free (`asyncio.to_thread` hands each call to any thread of the
event loop's default executor, and the model is loaded on yet another), several teams end up
spinning and sleeping against each other on the same cores, which slows every step (a
bfloat16 decode step of 16 sequences measured 1.6-1.9x slower).

Invariant: every call submitted here runs on the same OS thread, in submission order, one at a
time; `call` blocks the caller until it is done, `call_async` awaits it without blocking the
event loop. Exceptions propagate to the caller unchanged. Calling either from the rank thread
itself would deadlock, so the rank never calls back into its own `RankThread`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class RankThread:
    """A single worker thread owned by one in-process rank (see the module doc)."""

    def __init__(
        self, name: str = "pagedserve-rank0", initializer: Callable[[], object] | None = None
    ) -> None:
        """`initializer` runs first on the new thread (per-thread state such as torch's
        OpenMP thread count, which each thread keeps for itself)."""
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=initializer
        )

    def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn(*args, **kwargs)` on the rank thread and return its result (blocking)."""
        return self._executor.submit(fn, *args, **kwargs).result()

    async def call_async(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`call`, awaitable: the event loop keeps running while the rank works."""
        return await asyncio.wrap_future(self._executor.submit(fn, *args, **kwargs))

    def close(self) -> None:
        """Finish what was submitted, then end the thread (idempotent)."""
        self._executor.shutdown(wait=True)
