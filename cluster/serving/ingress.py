"""The application's entry: `OpenAIIngress`, in front of the engine deployment.

Every way in lands here: HTTP (a FastAPI ingress: OpenAI's completions, chat and Responses,
Anthropic's Messages and the tokenizer routes, `api_surface`) and gRPC (`GrpcMethods`, which
Serve's gRPC proxy routes to by RPC name). The ingress authenticates, validates, and admits each
request through the one `FrontEnd.submit` (rendered and tokenized once, with the engines' own
tokenizer and cache keys fetched from an engine replica at start, its blocks hashed once), which
calls the engine deployment through a handle (`RoutedEngineClient`), so `PrefixAwareRouter`
sends it to the replica holding the longest prefix. Ingress and engine replicas scale
independently; the engines never tokenize.

Invariants:
- the tenant salt that keys the prefix cache is derived here from the API key's tenant; no
  request field can choose it;
- `model` names the served model or a LoRA adapter the application's registry holds
  (`AdapterService`); anything else is a 404 `model_not_found` (gRPC: NOT_FOUND) before any
  engine is asked; adapters are loaded and unloaded at run time only through the registry,
  which every engine replica follows (cluster/serving/lora_registry.py);
- bad input is a 400 with OpenAI's error body (gRPC: INVALID_ARGUMENT); admission refusal a 503
  with Retry-After (gRPC: RESOURCE_EXHAUSTED); a body over `limits.max_body_bytes` a 413 before
  any of it is parsed;
- parsing, rendering and tokenizing run on the front end's threads, never on the event loop
  (which keeps /health and other requests responsive while a large prompt is handled);
- `/metrics` is open, needs an API key, or is served on its own port only (`limits.metrics`);
  `/health` is always open; the OpenAPI schema is at `/openapi.json`;
- a request that is cancelled (client disconnect, gRPC cancel) closes its engine stream, which
  cancels the call on the engine replica, aborts the request and frees its blocks;
- an engine replica that dies mid-request ends the request with an error the client can read;
- on shutdown (`pagedserve serve` got SIGINT/SIGTERM) new requests get a 503 with Retry-After
  and /health a 503, admitted ones run on until the grace period ends, then end with an error
  event (`DrainGate`, cluster/serving/drain.py).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI
from ray import serve

from cluster.engine.client import EngineClient
from cluster.engine.generate_request import RequestBuilder
from cluster.engine.tokenization import PromptRenderer
from cluster.serving.api_surface import build_serving_api
from cluster.serving.app_args import ServeAppArgs
from cluster.serving.directory_metrics import render_directory
from cluster.serving.drain import DrainGate, DrainingClient
from cluster.serving.drain_board import GateReporter, GcsKeyValue
from cluster.serving.engine_server import EngineDescription
from cluster.serving.error_map import grpc_abort
from cluster.serving.frontend import FrontEnd
from cluster.serving.grpc_service import GenerationRpc, GrpcMethods, cache_stats
from cluster.serving.kv_directory import DirectoryClient, directory_handle
from cluster.serving.lora_admin import AdapterService
from cluster.serving.lora_registry import registry_handle
from cluster.serving.lora_routes import BaseModelFacts
from cluster.serving.metrics_listener import MetricsListener
from cluster.serving.openai_serving import OpenAIServing
from cluster.serving.pd_client import DisaggregatedClient
from cluster.serving.prometheus import render_prometheus
from cluster.serving.reasoning_parsers import reasoning_tags
from cluster.serving.routed_engine import RoutedEngineClient, client_error, no_holdings
from cluster.serving.tenancy import Tenancy, Unauthenticated
from cluster.serving.tool_calls import ToolSettings
from protos import generation_pb2 as pb

INGRESS_NAME = "OpenAIIngress"


INGRESS_MAX_ONGOING_REQUESTS = 256
"""The ingress only waits on engines: it must not be what queues requests (admission control
and load shedding belong to the engines, which know their capacity)."""


@serve.deployment(name=INGRESS_NAME, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS)
@serve.ingress()
class OpenAIIngress(GrpcMethods):
    """The application's entry (see the module doc). `engine` is the engine deployment's
    handle; with `decode` (a disaggregated app's decode deployment) `engine` is its prefill
    deployment and each request runs as a prefill then a decode call (`DisaggregatedClient`)."""

    async def __init__(self, engine: Any, args: dict[str, Any], decode: Any = None) -> None:
        self.engine = engine
        self.decode = decode
        self.args = ServeAppArgs.model_validate(args)
        description: EngineDescription = await engine.describe.remote()
        self.description = description
        info = description.model_info
        renderer = PromptRenderer(description.tokenizer, info.vocab_size)
        builder = RequestBuilder(renderer, description.block_size, self.args.shared_prefixes)
        self.tenancy = Tenancy(self.args.tenants_by_key(), self.args.admin_keys())
        settings = self.args.directory
        app_name = serve.get_replica_context().app_name
        name = self.args.served_model_name
        registry = None
        engine_config = self.args.engine_config()
        self.base_model = BaseModelFacts(
            engine_config.model.model, info.max_model_len, info.architecture
        )
        if engine_config.lora.enable_lora:
            registry = registry_handle(app_name, self.args.configured_adapters())
        self.adapters = AdapterService(name, registry)
        await self.adapters.start()
        self.directory = DirectoryClient(
            directory_handle(app_name, settings.max_entries, settings.replica_timeout_s),
            settings.query_timeout_s,
        )
        self.drain = DrainGate(
            GateReporter.if_runner(GcsKeyValue(), serve.get_replica_context().replica_id.unique_id)
        )
        self.drain.start()
        queue_timeout_s = self.args.limits.queue_timeout_s
        routed: EngineClient = RoutedEngineClient(engine, self.directory.holdings, queue_timeout_s)
        if decode is not None:
            routed = DisaggregatedClient(
                routed,
                RoutedEngineClient(decode, no_holdings, queue_timeout_s),  # by KV pressure
                prefill_deployment=engine.deployment_name,
            )
        client = DrainingClient(routed, self.drain)
        self.frontend = FrontEnd(
            builder,
            info.max_model_len,
            client,
            self.adapters,
            description.keys,
            generation_defaults=description.generation_defaults,
        )
        tools = ToolSettings(self.args.enable_auto_tool_choice, self.args.tool_call_parser)
        reasoning = reasoning_tags(self.args.reasoning_parser)
        self.openai = OpenAIServing(self.frontend, name, tools, reasoning)
        self.rpc = GenerationRpc(self.frontend, tools, reasoning)
        self.created = int(time.time())
        self.metrics_listener: MetricsListener | None = None
        metrics_args = self.args.limits.metrics
        if metrics_args.port is not None:
            self.metrics_listener = MetricsListener(
                self._prometheus_body, "0.0.0.0", metrics_args.port
            )
            await self.metrics_listener.start()

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica: stop the drain gate, close the metrics
        port, stop watching the adapter registry."""
        drain = getattr(self, "drain", None)
        if drain is not None:
            await drain.close()
        listener = getattr(self, "metrics_listener", None)  # absent when __init__ failed
        if listener is not None:
            await listener.close()
        adapters = getattr(self, "adapters", None)
        if adapters is not None:
            await adapters.close()

    async def prometheus_text(self) -> tuple[str, bytes]:
        """The id of the engine replica that answered, and its metrics and the KV directory's
        in Prometheus' format."""
        replica_id, engine_metrics = await self.engine.metrics.remote()
        snapshots = {replica_id: engine_metrics}
        if self.decode is not None:
            decode_id, decode_metrics = await self.decode.metrics.remote()
            snapshots[decode_id] = decode_metrics
        text = render_prometheus(snapshots)
        return replica_id, text + render_directory(await self.directory.report(), self.directory)

    async def _prometheus_body(self) -> bytes:
        return (await self.prometheus_text())[1]

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_serving_api(self)

    async def engine_problem(self) -> str | None:
        """Why the engines cannot serve now (or this server is shutting down), as one engine
        replica reports it, or None."""
        if self.drain.problem is not None:
            return self.drain.problem
        for deployment in (self.engine, self.decode):
            if deployment is None:
                continue
            try:
                problem: str | None = await deployment.health_report.remote()
            except Exception as error:  # no replica could answer: that is the problem
                mapped = client_error(error)
                return str(mapped if mapped is not None else error)
            if problem is not None:
                return problem
        return None

    # --- gRPC hooks (GrpcMethods) ------------------------------------------------------------

    async def grpc_serving(self) -> bool:
        return await self.engine_problem() is None

    def grpc_tenant_salt(self, authorization: str | None) -> bytes | None:
        try:
            return self.tenancy.salt_for(authorization)
        except Unauthenticated as error:
            raise grpc_abort(error) from None

    async def grpc_model_info(self) -> pb.ModelInfo:
        description = self.description
        return self.rpc.model_info(
            description.model_info, description.block_size, description.tensor_parallel_size
        )

    async def grpc_cache_stats(self) -> pb.CacheStats:
        _, metrics = await self.engine.metrics.remote()
        return cache_stats(metrics)
