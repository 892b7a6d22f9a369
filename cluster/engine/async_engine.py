"""The asyncio engine: a step loop over `EngineCore`, per-request output streams and abort,
and `EngineActor`, the same engine as a Ray actor (with `RemoteEngine`, its client).

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
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from block_manager import CacheKey
from cluster.engine.config import EngineConfig
from cluster.engine.engine_core import EngineCore, PromptInput
from cluster.engine.errors import EngineDead, RequestRejected
from cluster.engine.metrics import EngineMetrics
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from workers import ModelInfo, WorkerGroup

log = logging.getLogger(__name__)

StreamItem = RequestOutput | BaseException
IDLE_STEP_PAUSE_S = 0.001


@dataclass(frozen=True)
class EngineHealth:
    """A snapshot of the step loop's health.

    `alive` is False once the loop failed or the engine was shut down (`error` says which);
    `last_step_finished_s` is `time.monotonic()` when the last step finished (None before the
    first); `num_unfinished` counts requests waiting, running or swapped.
    """

    alive: bool
    error: str | None
    last_step_finished_s: float | None
    num_unfinished: int


class AsyncEngine:
    """Continuous batching behind an async API. Create it inside a running event loop's thread;
    the step loop starts with the first request."""

    def __init__(self, config: EngineConfig, workers: WorkerGroup | None = None) -> None:
        self.core = EngineCore(config, workers)
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._pending_aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._stepping = False
        self._dead: BaseException | None = None
        self._shut_down = False
        self._last_step_finished_s: float | None = None

    # --- public API ---------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        tenant_salt: bytes | None = None,
        chat_template: str | None = None,
        shared_prefix_tokens: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (deltas since the previous one) until it finishes.
        Raises RequestRejected / EngineOverloaded before the first output when it cannot queue;
        leaving the iteration early aborts the request. The prompt's first
        `shared_prefix_tokens` tokens (an operator-shared prefix) are cached for every tenant:
        their whole blocks are hashed without `tenant_salt`, the rest with it."""
        if self._dead is not None:
            raise EngineDead(f"the engine stopped: {self._dead!r}")
        self._ensure_loop()
        request = self.core.add_request(
            prompt,
            params,
            request_id=request_id,
            tenant_salt=tenant_salt,
            chat_template=chat_template,
            shared_prefix_tokens=shared_prefix_tokens,
        )
        rid = request.request_id
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

    def prompt_token_ids(self, prompt: PromptInput, chat_template: str | None = None) -> list[int]:
        """The token ids the engine runs for `prompt` (rendered and tokenized); raises
        RequestRejected for a prompt it cannot render."""
        return self.core.renderer.render(prompt, chat_template=chat_template).token_ids

    def prompt_block_hashes(
        self,
        prompt: PromptInput,
        *,
        tenant_salt: bytes | None,
        chat_template: str | None = None,
        shared_prefix_tokens: int = 0,
    ) -> list[bytes]:
        """Chain hashes of the prompt's blocks a cache lookup could hit, keyed exactly as
        `generate` with the same arguments would cache them (see `EngineCore`)."""
        return self.core.prompt_block_hashes(
            prompt,
            tenant_salt=tenant_salt,
            chat_template=chat_template,
            shared_prefix_tokens=shared_prefix_tokens,
        )

    @property
    def block_size(self) -> int:
        return self.core.config.cache.block_size

    def plain_cache_key(self, tenant_salt: bytes | None) -> CacheKey:
        """The cache key of a tenant's text and token-id prompts (no chat template, no shared
        prefix): with `block_size`, what a caller needs to hash token ids as this engine does."""
        return self.core.cache_keys.key(tenant_salt=tenant_salt)

    def cached_block_hashes(self, limit: int) -> list[bytes]:
        """At most `limit` chain hashes of blocks the engine holds cached on the device now
        (in use ones first, then evictable ones, those evicted last first)."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        return list(itertools.islice(self.core.block_manager.cached_block_hashes(), limit))

    def model_info(self) -> ModelInfo:
        return self.core.model_info

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.core.renderer.encode(text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.core.renderer.decode(token_ids, skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], chat_template: str | None = None
    ) -> str:
        rendered = self.core.renderer.render_chat(messages, chat_template=chat_template)
        return rendered.text or ""

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


class EngineActorImpl:
    """The Ray actor body: an `AsyncEngine` in the actor's event loop. Create with
    `EngineActor.remote(config)` (the config as a dict, so any process can send it)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.engine = AsyncEngine(EngineConfig.build(config))

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        tenant_salt: bytes | None = None,
        chat_template: str | None = None,
        shared_prefix_tokens: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        async for output in self.engine.generate(
            prompt,
            params,
            request_id=request_id,
            tenant_salt=tenant_salt,
            chat_template=chat_template,
            shared_prefix_tokens=shared_prefix_tokens,
        ):
            yield output

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def metrics(self) -> EngineMetrics:
        return self.engine.metrics()

    def health(self) -> EngineHealth:
        return self.engine.health()

    def cached_block_hashes(self, limit: int) -> list[bytes]:
        return self.engine.cached_block_hashes(limit)

    def prompt_block_hashes(
        self,
        prompt: PromptInput,
        tenant_salt: bytes | None,
        chat_template: str | None = None,
        shared_prefix_tokens: int = 0,
    ) -> list[bytes]:
        return self.engine.prompt_block_hashes(
            prompt,
            tenant_salt=tenant_salt,
            chat_template=chat_template,
            shared_prefix_tokens=shared_prefix_tokens,
        )

    def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.engine.decode(token_ids, skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], chat_template: str | None = None
    ) -> str:
        return self.engine.apply_chat_template(messages, chat_template)

    async def shutdown(self) -> None:
        await self.engine.shutdown()


EngineActor = ray.remote(num_cpus=0)(EngineActorImpl)


class RemoteEngine:
    """Client side of an `EngineActor`: the same `generate`/`abort`/`metrics` as `AsyncEngine`."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    @classmethod
    def start(cls, config: EngineConfig, **actor_options: Any) -> RemoteEngine:
        handle = EngineActor.options(**actor_options).remote(config.model_dump())
        return cls(handle)

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        tenant_salt: bytes | None = None,
        chat_template: str | None = None,
        shared_prefix_tokens: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        rid = request_id if request_id is not None else f"remote-{uuid.uuid4().hex}"
        stream = self.handle.generate.options(num_returns="streaming").remote(
            prompt, params, rid, tenant_salt, chat_template, shared_prefix_tokens
        )
        finished = False
        try:
            async for ref in stream:
                output: RequestOutput = await ref
                finished = output.finished
                yield output
        finally:
            if not finished:
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        await self.handle.abort.remote(request_id)

    async def metrics(self) -> EngineMetrics:
        return await self.handle.metrics.remote()

    async def health(self) -> EngineHealth:
        return await self.handle.health.remote()

    async def cached_block_hashes(self, limit: int) -> list[bytes]:
        return await self.handle.cached_block_hashes.remote(limit)

    async def prompt_block_hashes(
        self,
        prompt: PromptInput,
        *,
        tenant_salt: bytes | None,
        chat_template: str | None = None,
        shared_prefix_tokens: int = 0,
    ) -> list[bytes]:
        return await self.handle.prompt_block_hashes.remote(
            prompt, tenant_salt, chat_template, shared_prefix_tokens
        )

    async def model_info(self) -> ModelInfo:
        return await self.handle.model_info.remote()

    async def shutdown(self) -> None:
        await self.handle.shutdown.remote()
        ray.kill(self.handle)
