"""The engine deployment: each replica owns one `AsyncEngine` (one TP group's pools) and runs
the `GenerateRequest`s the ingress sends it through a deployment handle.

The replica renders nothing: requests arrive rendered and tokenized by the ingress, with what
`PrefixAwareRouter` reads to choose the replica holding the longest prefix (`prefix_blocks`,
from the KV directory, and the request's own `block_hashes`). The replica streams its block
manager's events to the KV directory (`DirectoryPublisher`), reports its load to the routers
(`record_routing_stats`) and KV pressure to the autoscaler (`record_autoscaling_stats`), and
reports itself unhealthy when its step loop died or stopped moving (`check_health`).

Invariants:
- a replica touches its engine only from its own event loop (every method here is async);
- it streams `RequestDelta`s (O(new tokens) each over the handle; the client folds them into
  `RequestOutput`s), each carrying `served_by` (this replica's id), and at least the app's
  `stream_interval` new tokens each once the first token is out, except the last;
- nothing blocks its event loop on Ray: the engine is built and shut down in a worker thread;
- closing a `generate` stream (the ingress's client went away) aborts the request and frees its
  blocks;
- with LoRA on, a replica serves the application registry's adapters (the configured
  `lora_modules` plus those loaded at run time) before it takes traffic, and follows every
  later change (`AdapterSync`): a replica started later serves the same adapters as the others.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.cache_keys import RequestKeys
from cluster.engine.client import ModelInfo
from cluster.engine.generate_request import GenerateRequest
from cluster.engine.generation_defaults import GenerationDefaults
from cluster.engine.metrics import EngineMetrics
from cluster.engine.output_stream import RequestDelta
from cluster.kv_transfer.cost_model import TransferCostModel
from cluster.kv_transfer.payload import KVPayload
from cluster.kv_transfer.puller import PullSettings
from cluster.kv_transfer.service import KVTransferService
from cluster.serving.app_args import DEPLOYMENT_NAME, ServeAppArgs
from cluster.serving.autoscaling import autoscaling_stats
from cluster.serving.kv_directory import (
    CacheSource,
    DirectoryClient,
    DirectoryPublisher,
    directory_handle,
)
from cluster.serving.kv_transport import ServeKVTransport
from cluster.serving.lora_registry import registry_handle
from cluster.serving.lora_sync import AdapterSync
from cluster.serving.replica_health import StepProgress, replica_problem
from cluster.serving.routing import ROUTER_CLASS_PATH, LoadReport, routing_stats

ROUTING_STATS_PERIOD_S = 1.0
HEARTBEAT_S = 1.0
"""An idle replica still tells the KV directory it is alive this often (at most a quarter of
the directory's replica timeout)."""


async def stream_as_replica(
    engine: AsyncEngine, request: GenerateRequest, args: ServeAppArgs, replica_id: str
) -> AsyncIterator[RequestDelta]:
    """The engine's deltas for `request` paced as the application streams them
    (`stream_interval`, `stream_chunks_per_step`), each marked `served_by` `replica_id`;
    closing this stream closes the engine's, which aborts the request."""
    stream = engine.generate(request, args.stream_interval, args.stream_chunks_per_step)
    try:
        async for delta in stream:
            delta.served_by = replica_id
            yield delta
    finally:
        await stream.aclose()


@dataclass(frozen=True)
class EngineDescription:
    """What an ingress needs to prepare requests exactly as the engines key and run them: the
    tokenizer, the cache keys (identity seed, block size), the model and its parallelism, and
    the sampling requests get for fields they leave unset (the engine read it from the model)."""

    tokenizer: Any
    keys: RequestKeys
    model_info: ModelInfo
    tensor_parallel_size: int
    generation_defaults: GenerationDefaults

    @property
    def block_size(self) -> int:
        return self.keys.block_size


@serve.deployment(
    name=DEPLOYMENT_NAME,
    request_router_config=RequestRouterConfig(
        request_router_class=ROUTER_CLASS_PATH,
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
    ),
)
class GenerationServer:
    """One engine replica (see the module doc)."""

    async def __init__(self, args: dict[str, Any]) -> None:
        self.args = ServeAppArgs.model_validate(args)
        self.config = self.args.engine_config()
        self.engine = await AsyncEngine.create(self.config, record_block_events=True)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.progress = StepProgress(self.args.health.stuck_after_s)
        directory = self.args.directory
        source = CacheSource(
            take_events=self.engine.take_block_events,
            hashes_by_tier=self.engine.cached_hashes_by_tier,
            pressure=self.engine.pressure,
        )
        self.publisher = DirectoryPublisher(
            directory_handle(context.app_name, directory.max_entries, directory.replica_timeout_s),
            self.replica_id,
            source,
            directory.publish_period_s,
            heartbeat_s=min(HEARTBEAT_S, directory.replica_timeout_s / 4),
        )
        self.publisher.start()
        self._attach_kv_transfer(context.app_name, context.deployment)
        self.adapter_sync: AdapterSync | None = None
        if self.config.lora.enable_lora:
            configured = self.args.configured_adapters()
            registry = registry_handle(context.app_name, configured)
            self.adapter_sync = AdapterSync(
                registry, self.engine, self.replica_id, configured, self.engine.adapter_digests
            )
            await self.adapter_sync.start()

    def _attach_kv_transfer(self, app_name: str, deployment: str) -> None:
        """Serve this replica's blocks to peers, and (unless off) pull missing prefixes from
        the replica the directory names (of this replica's own `deployment`) or a request's
        hint names (`cluster.kv_transfer`)."""
        if not self.engine.core.shares_prefixes:
            return
        settings = self.args.kv_transfer
        self.kv_transfer = KVTransferService(
            self.replica_id,
            self.engine.core,
            ServeKVTransport(app_name, deployment),
            DirectoryClient(self.publisher.directory, self.args.directory.query_timeout_s),
            PullSettings(settings.timeout_s, settings.min_blocks, settings.use_cost_model),
            TransferCostModel(bandwidth_prior_bytes_per_s=settings.bandwidth_prior_bytes_per_s),
            pull=settings.pull,
            on_pulled=self._report_pull,
        )
        self.engine.attach_kv_transfer(self.kv_transfer)

    def _report_pull(self, holder: str, blocks: int, num_bytes: int) -> None:
        """Tell the directory (fire and forget: a lost report only costs a figure)."""
        with contextlib.suppress(Exception):
            self.publisher.directory.record_transfer.remote(
                holder, self.replica_id, blocks, num_bytes
            )

    async def export_kv(
        self, block_keys: list[bytes], target_replica: str | None = None
    ) -> KVPayload:
        """A peer's pull: this replica's blocks for the leading run of `block_keys` (exact
        hash preimages) it holds; `target_replica` is read by the router only."""
        return await self.engine.export_kv_blocks(block_keys)

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica: stop the step loop and the workers."""
        sync = getattr(self, "adapter_sync", None)  # absent when the constructor failed
        if sync is not None:
            await sync.close()
        publisher = getattr(self, "publisher", None)
        if publisher is not None:
            await publisher.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.shutdown()

    async def describe(self) -> EngineDescription:
        return EngineDescription(
            tokenizer=self.engine.request_builder.renderer.tokenizer,
            keys=self.engine.core.request_keys,
            model_info=self.engine.model_info(),
            tensor_parallel_size=self.config.parallel.tensor_parallel_size,
            generation_defaults=self.engine.core.generation_defaults,
        )

    async def generate(
        self,
        request: GenerateRequest,
        prefix_blocks: dict[str, int] | None = None,
        target_replica: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Streams the engine's deltas (fold them with an `OutputAccumulator`); the request's
        `block_hashes`, `prefix_blocks` and `target_replica` (a replica id the caller wants
        the request on, e.g. a decode replica named by a disaggregated proxy) are read by the
        router only. Raises RequestRejected,
        EngineOverloaded, EngineDead like the engine, before the first delta."""
        stream = stream_as_replica(self.engine, request, self.args, self.replica_id)
        async with contextlib.aclosing(stream):
            async for delta in stream:
                yield delta

    async def metrics(self, target_replica: str | None = None) -> tuple[str, EngineMetrics]:
        """This replica's id and its engine's metrics (what /metrics and cache stats show);
        `target_replica` is read by the router only."""
        return self.replica_id, self.engine.metrics()

    def health_problem(self) -> str | None:
        """Why this replica should not get traffic, or None: a dead or shut-down step loop
        (even while idle), or one that has work but stopped stepping."""
        return replica_problem(
            self.engine.health(), self.progress, self.engine.metrics(), time.monotonic()
        )

    async def health_report(self) -> str | None:
        return self.health_problem()

    async def check_health(self) -> None:
        """Serve calls this periodically and replaces a replica for which it raises."""
        problem = self.health_problem()
        if problem is not None:
            raise RuntimeError(problem)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve calls this periodically; every router of this deployment receives it."""
        return routing_stats(LoadReport.of(self.engine.metrics()))

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this periodically; the autoscaling policy receives it."""
        return autoscaling_stats(self.engine.metrics())
