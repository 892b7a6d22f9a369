"""The asyncio engine: a step loop over `EngineCore`, per-request output streams and abort.

It is the in-process `EngineClient` (see `cluster.engine.client`): a Serve replica owns one and
its front ends call it; a routed client over deployment handles implements the same protocol.

Invariants: a step's plan is built between steps, never while one executes; an abort that
arrives while a step is being awaited or settled is applied right after its settle (with
`scheduler.async_scheduling` the next step is already on the workers then, see
`cluster.engine.step_pipeline`); every stream ends with an output whose `finished` is True, or
with the exception that stopped the request.

Failure isolation is `EngineCore.finish_step`'s: a refused plan or a token that cannot be applied
ends only the requests it is blamed on (their streams raise RequestFailed); any other failure of
the workers or their transport (a dead rank actor, a collective error) or of the scheduler
marks the engine dead and ends every stream with EngineDead.

Streams cost O(new tokens) per step: the loop hands each stream a `RequestDelta`, which its
`OutputMailbox` coalesces while the reader is behind (one pending item, never a queue of
snapshots); `generate` yields them as they are (see `output_stream`).

Nothing here blocks the event loop on Ray: the engine is built (`AsyncEngine.create`) and shut
down in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from block_manager import BlockEvent, PressureSnapshot
from cluster.engine.background import cancel_and_wait
from cluster.engine.client import EngineHealth
from cluster.engine.config import EngineConfig
from cluster.engine.engine_core import EngineCore
from cluster.engine.errors import EngineDead, RequestFailed, RequestRejected
from cluster.engine.generate_request import GenerateRequest, RequestBuilder
from cluster.engine.lora_request import LoRARequest
from cluster.engine.metrics import EngineMetrics
from cluster.engine.output_stream import OutputMailbox, RequestDelta, chunk_tokens
from cluster.engine.request import Request
from cluster.engine.scheduler_step import SchedulerStep
from cluster.engine.step_pipeline import StepPipeline
from cluster.kv_transfer.hooks import KVTransferHooks
from cluster.kv_transfer.payload import KVPayload
from workers import ModelInfo, WorkerGroup
from workers.plan import StepOutput

log = logging.getLogger(__name__)

IDLE_STEP_PAUSE_S = 0.001
GRAMMAR_COMPILE_TIMEOUT_S = 30.0
"""A structured-outputs constraint that takes longer to compile is refused (RequestRejected)."""


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
        """Builds the engine in the calling thread (it loads the model and, on the Ray backend,
        waits for the worker actors); from a coroutine use `await AsyncEngine.create(...)`.
        `record_block_events`: keep the block manager's events for `take_block_events` (a
        replica that publishes to the KV directory)."""
        self.core = EngineCore(config, workers, record_block_events=record_block_events)
        self._streams: dict[str, OutputMailbox] = {}
        self._pending_aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._stepping = False
        self._dead: BaseException | None = None
        self._shut_down = False
        self._last_step_finished_s: float | None = None
        self._pipeline: StepPipeline[asyncio.Task[StepOutput | Exception | None]] = StepPipeline(
            self.core, self._launch, overlap=config.scheduler.async_scheduling
        )
        self.kv_transfer: KVTransferHooks | None = None
        """Pulls a request's missing leading blocks from a peer before it is queued, and
        serves this replica's blocks to peers (`attach_kv_transfer`)."""

    @classmethod
    async def create(
        cls,
        config: EngineConfig,
        workers: WorkerGroup | None = None,
        *,
        record_block_events: bool = False,
    ) -> AsyncEngine:
        """Builds the engine in a worker thread, so the event loop keeps serving meanwhile."""
        return await asyncio.to_thread(
            cls, config, workers, record_block_events=record_block_events
        )

    # --- public API ---------------------------------------------------------------------

    async def generate(
        self,
        request: GenerateRequest,
        stream_interval: int = 1,
        chunks_per_step: int | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Streams the request's `RequestDelta`s until it finishes (O(new tokens) each, what a
        replica sends over a deployment handle; fold them with an `OutputAccumulator` for a
        whole answer). Raises RequestRejected / EngineOverloaded before the first delta when it
        cannot queue, RequestFailed / EngineDead when a step fails; leaving the iteration early
        aborts the request. With `stream_interval` N > 1 each delta after the first token
        carries at least N new tokens unless it is the last (`OutputMailbox.get`); with
        `chunks_per_step` C, at least ceil(running sequences / C) too, read when each chunk
        is waited for (`output_stream.chunk_tokens`)."""
        chunk_tokens(stream_interval, chunks_per_step, 0)  # bad pacing fails before queueing
        if self._dead is not None:
            raise EngineDead(f"the engine stopped: {self._dead!r}")
        self._ensure_loop()
        constraint = None
        if request.params.structured_outputs is not None:  # compiled off the event loop
            try:
                constraint = await asyncio.wait_for(
                    asyncio.to_thread(self.core.compile_constraint, request),
                    GRAMMAR_COMPILE_TIMEOUT_S,
                )
            except TimeoutError:
                kind = request.params.structured_outputs.spec.kind
                raise RequestRejected(
                    f"structured_outputs.{kind}: the constraint did not compile within "
                    f"{GRAMMAR_COMPILE_TIMEOUT_S:.0f} s"
                ) from None
        pulled = None
        if self.kv_transfer is not None:  # in this coroutine: steps go on meanwhile
            pulled = await self.kv_transfer.prepare(request)
        try:
            rid = self.core.add_request(request, constraint).request_id
        except BaseException:
            if pulled is not None:
                pulled.release()
            raise
        mailbox = OutputMailbox()
        self._streams[rid] = mailbox
        self._wake()
        finished = False
        try:
            while not finished:
                wanted = chunk_tokens(stream_interval, chunks_per_step, self.core.num_running())
                delta = await mailbox.get(wanted)
                if pulled is not None:  # its first output: the request holds its blocks
                    pulled.release()
                finished = delta.finished
                if delta.error is not None:
                    raise RequestRejected(delta.error)
                yield delta
        except (RequestFailed, EngineDead):
            finished = True  # the engine ended the request already
            raise
        finally:
            if pulled is not None:
                pulled.release()
            self._streams.pop(rid, None)
            if not finished:
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        """Frees every block of the request now (or right after the step in flight)."""
        if self._stepping:
            self._pending_aborts.append(request_id)
            return
        self._apply_abort(request_id)
        self._wake()  # an idle loop sends the workers the release

    async def add_lora(self, lora: LoRARequest) -> None:
        """Loads the adapter on every rank (in a worker thread: the step loop keeps running,
        and on Ray the ranks take it between steps), then serves it under its name. Raises
        InvalidAdapter naming the problem (nothing already loaded changes), RequestRejected
        when LoRA is off."""
        summary = await asyncio.to_thread(self.core.load_lora_weights, lora)
        self.core.register_lora(lora, summary)  # on the loop's thread, between steps

    async def remove_lora(self, lora_name: str) -> None:
        """Stops serving the adapter; its requests in flight finish, then its weights go.
        Raises AdapterNotFound for a name not loaded."""
        self.core.remove_lora(lora_name)

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters served now, in load order."""
        return self.core.list_loras()

    def adapter_digests(self) -> dict[str, str]:
        """Adapter name -> weights digest as served now: what a copy of the engine's
        `RequestKeys` held elsewhere (an ingress hashing prompts for routing) must set as its
        `adapters` to key adapter requests exactly as this engine caches them."""
        return dict(self.core.request_keys.adapters)

    def metrics(self) -> EngineMetrics:
        metrics = self.core.metrics()
        if self.kv_transfer is not None:
            metrics.kv_transfer = self.kv_transfer.snapshot()
        return metrics

    def attach_kv_transfer(self, service: KVTransferHooks) -> None:
        """From now on requests pull missing leading blocks through `service` (see
        `cluster.kv_transfer.puller`), and `export_kv_blocks` serves peers."""
        self.kv_transfer = service

    async def export_kv_blocks(self, block_keys: list[bytes]) -> KVPayload:
        """A peer's pull: this replica's blocks for the leading run of `block_keys` it holds
        (see `cluster.kv_transfer.exporter`); empty when no transfer service is attached."""
        if self.kv_transfer is None:
            return KVPayload("")
        return await self.kv_transfer.export_blocks(block_keys)

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

    @property
    def request_builder(self) -> RequestBuilder:
        """Renders prompts for this engine's tokenizer (no operator shared prefixes)."""
        return self.core.request_builder

    def take_block_events(self) -> list[BlockEvent]:
        """The block manager's seals and evictions since the last call (see `BlockEvent`);
        [] unless built with `record_block_events` under a layout that seals blocks."""
        events = self.core.block_events
        return [] if events is None else events.take_events()

    def pressure(self) -> PressureSnapshot:
        """Both tiers' block counts now (what `metrics()` reports, without its copies)."""
        return self.core.block_manager.pressure()

    def cached_hashes_by_tier(self) -> dict[str, list[bytes]]:
        """Every hash a prefix lookup can hit now, per tier (a full scan: for resyncs)."""
        events = self.core.block_events
        return {"device": [], "cpu": []} if events is None else dict(events.cached_hashes_by_tier())

    def model_info(self) -> ModelInfo:
        return self.core.model_info

    async def shutdown(self) -> None:
        """Stops the step loop and the workers (in a worker thread: it waits on Ray)."""
        self._shut_down = True
        await cancel_and_wait(self._loop_task)
        self._loop_task = None
        for handle in self._pipeline.handles:  # steps launched ahead
            await cancel_and_wait(handle)
        await asyncio.to_thread(self.core.shutdown)

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
                if self._pipeline.in_flight is None and not self.core.has_work():
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
            for mailbox in self._streams.values():
                mailbox.fail(EngineDead(f"the engine stopped: {error!r}"))

    async def _one_step(self) -> None:
        """One step of the `StepPipeline`: await the step in flight (launching it when none
        is), apply its first half, yield once so that an overlapped next step reaches the
        workers, then settle and publish. Aborts that arrive meanwhile wait for the end."""
        in_flight = self._pipeline.start()
        if in_flight is None:
            return
        self._stepping = True
        try:
            step = self._pipeline.advance(await in_flight)
            if self._pipeline.in_flight is not None:
                await asyncio.sleep(0)  # the next step's task starts its execution
            requests = self._pipeline.settle()
        finally:
            self._stepping = False
        self._last_step_finished_s = time.monotonic()
        for request in requests:
            self._publish(request)
        self._apply_pending_aborts()
        if not step.runs_anything and not requests and self.core.has_unfinished():
            await asyncio.sleep(IDLE_STEP_PAUSE_S)  # nothing could run: do not spin

    def _launch(self, step: SchedulerStep) -> asyncio.Task[StepOutput | Exception | None]:
        return asyncio.get_running_loop().create_task(self._execute(step))

    async def _execute(self, step: SchedulerStep) -> StepOutput | Exception | None:
        """The step's execution on the workers: their output, None for an empty plan, or the
        exception they raised (judged by `EngineCore.advance_step`)."""
        if step.is_empty:
            return None
        try:
            return await self.core.workers.execute_async(step.plan)
        except Exception as error:  # a refusal or broken workers
            return error

    def _apply_pending_aborts(self) -> None:
        aborts, self._pending_aborts = self._pending_aborts, []
        for request_id in aborts:
            self._apply_abort(request_id)

    def _apply_abort(self, request_id: str) -> None:
        request = self.core.abort(request_id)
        if request is not None:
            self._publish(request)

    def _publish(self, request: Request) -> None:
        """Hands the request's change to its stream (a failed one ends it with RequestFailed).
        The delta is made even without a reader, so streamed positions stay in step."""
        if request.failed:
            mailbox = self._streams.get(request.request_id)
            if mailbox is not None:
                mailbox.fail(RequestFailed(request.error or "the step running it failed"))
            return
        delta = request.make_delta()
        mailbox = self._streams.get(request.request_id)
        if mailbox is not None:
            mailbox.put(delta)
