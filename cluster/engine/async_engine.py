"""The asyncio engine: a step loop over `EngineCore`, per-request output streams and abort.

It is the in-process `EngineClient` (see `cluster.engine.client`): a Serve replica owns one and
its front ends call it; a routed client over deployment handles implements the same protocol.

Invariants: the block manager and scheduler are touched only between steps (an abort that arrives
while the workers execute a step is applied right after it); every stream ends with an output
whose `finished` is True, or with the exception that stopped the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator

from block_manager import BlockEvent
from cluster.engine.client import EngineHealth
from cluster.engine.config import EngineConfig
from cluster.engine.engine_core import EngineCore
from cluster.engine.errors import EngineDead, RequestRejected
from cluster.engine.generate_request import GenerateRequest, RequestBuilder
from cluster.engine.metrics import EngineMetrics
from cluster.engine.outputs import RequestOutput
from workers import ModelInfo, WorkerGroup

log = logging.getLogger(__name__)

StreamItem = RequestOutput | BaseException
IDLE_STEP_PAUSE_S = 0.001


class AsyncEngine:
    """Continuous batching behind an async API. Create it inside a running event loop's thread;
    the step loop starts with the first request."""

    def __init__(
        self,
        config: EngineConfig,
        workers: WorkerGroup | None = None,
        *,
        record_block_events: bool = False,
    ) -> None:
        """`record_block_events`: keep the block manager's events for `take_block_events` (a
        replica that publishes to the KV directory)."""
        self.core = EngineCore(config, workers, record_block_events=record_block_events)
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._pending_aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._stepping = False
        self._dead: BaseException | None = None
        self._shut_down = False
        self._last_step_finished_s: float | None = None

    # --- public API ---------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (deltas since the previous one) until it finishes.
        Raises RequestRejected / EngineOverloaded before the first output when it cannot queue;
        leaving the iteration early aborts the request."""
        if self._dead is not None:
            raise EngineDead(f"the engine stopped: {self._dead!r}")
        self._ensure_loop()
        rid = self.core.add_request(request).request_id
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._streams[rid] = queue
        self._wake()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestRejected(item.error)
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        """Frees every block of the request now (or right after the step in flight)."""
        if self._stepping:
            self._pending_aborts.append(request_id)
            return
        self._apply_abort(request_id)

    def metrics(self) -> EngineMetrics:
        return self.core.metrics()

    def health(self) -> EngineHealth:
        """Whether the step loop can still serve (a dead loop is reported even when idle)."""
        error = None
        if self._dead is not None:
            error = f"the engine step loop failed: {self._dead!r}"
        elif self._shut_down:
            error = "the engine was shut down"
        return EngineHealth(
            alive=error is None,
            error=error,
            last_step_finished_s=self._last_step_finished_s,
            num_unfinished=self.core.scheduler.num_unfinished(),
        )

    def prompt_block_hashes(self, request: GenerateRequest) -> list[bytes]:
        """Chain hashes of the request's blocks a cache lookup could hit, keyed exactly as
        `generate` would cache them (see `EngineCore`)."""
        return self.core.prompt_block_hashes(request)

    @property
    def block_size(self) -> int:
        return self.core.config.cache.block_size

    @property
    def request_builder(self) -> RequestBuilder:
        """Renders prompts for this engine's tokenizer (no operator shared prefixes)."""
        return self.core.request_builder

    def cached_block_hashes(self, limit: int) -> list[bytes]:
        """At most `limit` chain hashes of blocks the engine holds cached on the device now
        (in use ones first, then evictable ones, those evicted last first)."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        return list(itertools.islice(self.core.block_manager.cached_block_hashes(), limit))

    def take_block_events(self) -> list[BlockEvent]:
        """The block manager's seals and evictions since the last call (see `BlockEvent`);
        [] unless built with `record_block_events`."""
        return self.core.block_manager.take_events()

    def cached_hashes_by_tier(self) -> dict[str, list[bytes]]:
        """Every hash a prefix lookup can hit now, per tier (a full scan: for resyncs)."""
        return dict(self.core.block_manager.cached_hashes_by_tier())

    def model_info(self) -> ModelInfo:
        return self.core.model_info

    async def shutdown(self) -> None:
        self._shut_down = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        self.core.shutdown()

    # --- the step loop --------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run(self) -> None:
        assert self._wakeup is not None
        try:
            while True:
                if not self.core.has_unfinished():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                await self._one_step()
                await asyncio.sleep(0)  # let new requests and aborts in
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            log.exception("engine step loop failed")
            self._dead = error
            for queue in self._streams.values():
                queue.put_nowait(EngineDead(f"the engine stopped: {error!r}"))

    async def _one_step(self) -> None:
        step = self.core.begin_step()
        self._stepping = True
        try:
            output = None
            if not step.is_empty:
                output = await self.core.workers.execute_async(step.plan)
        finally:
            self._stepping = False
        outputs = self.core.finish_step(step, output) + self.core.resolve_stall(step)
        self._last_step_finished_s = time.monotonic()
        for item in outputs:
            self._publish(item)
        aborts, self._pending_aborts = self._pending_aborts, []
        for request_id in aborts:
            self._apply_abort(request_id)
        if step.is_empty and not outputs:
            await asyncio.sleep(IDLE_STEP_PAUSE_S)  # nothing could run: do not spin

    def _apply_abort(self, request_id: str) -> None:
        final = self.core.abort(request_id)
        if final is not None:
            self._publish(final)

    def _publish(self, output: RequestOutput) -> None:
        queue = self._streams.get(output.request_id)
        if queue is not None:
            queue.put_nowait(output)
