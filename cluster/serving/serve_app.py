"""The Ray Serve application: one deployment whose replica owns one engine and serves it over
OpenAI-compatible HTTP (a FastAPI ingress) and gRPC (`GrpcMethods`, which Serve's gRPC proxy
routes to by RPC name).

`serve run cluster/serving/serve_config.yaml` builds it through `build_app(args)`; `args` is
`ServeAppArgs`, whose engine section is `cluster.engine.config.EngineConfig`.

Invariants:
- a replica touches its engine only from its own event loop (every method here is async);
- the tenant salt that keys the prefix cache is derived on the server from the API key's tenant;
  no request field can choose it, so tenants never share cached blocks, except the whole blocks
  of an operator-declared shared prefix (`shared_prefixes`) that a prompt begins with;
- a request that is cancelled (client disconnect, gRPC cancel) closes its engine stream, which
  aborts the request and frees its blocks;
- bad input is a 400 with OpenAI's error body; admission refusal a 503 with Retry-After;
- the block hashes the engine holds cached are published (`cluster.serving.routing_replica`),
  and Serve hands them to the prefix-aware router (`cluster.serving.routing`) through
  `record_routing_stats`;
- a replica whose engine step loop died reports itself unhealthy, busy or idle;
  `record_autoscaling_stats` reports KV pressure to the autoscaling policy
  (`cluster.serving.autoscaling`).
"""

from __future__ import annotations

import hashlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.client import EngineHealth
from cluster.engine.config import EngineConfig
from cluster.engine.errors import RequestRejected
from cluster.engine.generate_request import PromptInput, RequestBuilder
from cluster.engine.metrics import EngineMetrics
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.autoscaling import autoscaling_stats
from cluster.serving.frontend import FrontEnd
from cluster.serving.grpc_service import GenerationRpc, GrpcAbort, GrpcMethods
from cluster.serving.ingress import HttpCall, HttpHead, PrefixRoutingIngress, asgi_call
from cluster.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    authentication_error,
    invalid_request,
    parse_request,
)
from cluster.serving.openai_serving import OpenAIServing
from cluster.serving.prefix_index import BlockHasher
from cluster.serving.prometheus import PROMETHEUS_CONTENT_TYPE, render_prometheus
from cluster.serving.routing import ROUTER_CLASS_PATH, RoutedOutput, RoutedRequest
from cluster.serving.routing_replica import ReplicaBlocks

DEPLOYMENT_NAME = "GenerationServer"
REPLICA_HEADER = "x-pagedserve-replica"
ROUTING_STATS_PERIOD_S = 1.0


class RoutingArgs(BaseModel):
    """Prefix-aware routing settings of a replica."""

    model_config = ConfigDict(extra="forbid")

    published_blocks: int = Field(
        4096, ge=1, description="block hashes a replica publishes to the routers (newest kept)"
    )
    http_ingress: bool = Field(
        False,
        description=(
            "serve HTTP through `PrefixRoutingIngress`, which hashes each prompt and routes it "
            "by prefix (gRPC is then not served by this application; see cluster.serving.ingress)"
        ),
    )


class HealthArgs(BaseModel):
    """When a replica reports itself unhealthy."""

    model_config = ConfigDict(extra="forbid")

    stuck_after_s: float = Field(
        60.0, gt=0, description="an engine with work whose step count has not moved this long"
    )


class ServeAppArgs(BaseModel):
    """The `args` of the Serve application (validated when the app is built)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field("SmolLM2-135M-Instruct", min_length=1)
    engine: dict[str, Any] = Field(
        default_factory=dict, description="cluster.engine.config.EngineConfig"
    )
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="API key -> tenant name; empty: no authentication and one shared tenant",
    )

    routing: RoutingArgs = Field(default_factory=RoutingArgs)
    health: HealthArgs = Field(default_factory=HealthArgs)
    shared_prefixes: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description=(
            "operator-chosen prompt prefixes (e.g. a system prompt, as the rendered prompt "
            "begins) whose whole KV blocks all tenants share; blocks after them stay per tenant"
        ),
    )

    def engine_config(self) -> EngineConfig:
        return EngineConfig.build(self.engine)


@dataclass
class StepProgress:
    """Stuck-engine detection from the engine's public metrics: it has requests running or
    waiting, yet its step count has not moved for `stuck_after_s` (a step loop that died with
    requests in flight looks the same). Returns the reason, or None while healthy."""

    stuck_after_s: float
    last_steps: int = -1
    last_change_s: float = 0.0
    was_idle: bool = True

    def problem(self, metrics: EngineMetrics, now_s: float) -> str | None:
        """The clock restarts whenever the engine stepped or was last seen without work."""
        idle = not (metrics.num_running + metrics.num_waiting)
        if metrics.num_steps != self.last_steps or idle or self.was_idle:
            self.last_steps, self.last_change_s, self.was_idle = metrics.num_steps, now_s, idle
            return None
        idle_s = now_s - self.last_change_s
        if idle_s < self.stuck_after_s:
            return None
        return (
            f"engine stuck: {metrics.num_running} running and {metrics.num_waiting} waiting "
            f"requests, no step for {idle_s:.0f} s"
        )


def replica_problem(
    health: EngineHealth, progress: StepProgress, metrics: EngineMetrics, now_s: float
) -> str | None:
    """Why a replica should not get traffic, or None: its engine's step loop died or was shut
    down (reported even while idle), or it has work but stopped stepping (`StepProgress`)."""
    if not health.alive:
        return health.error or "the engine is not running"
    return progress.problem(metrics, now_s)


class Unauthenticated(Exception):
    """A missing or unknown API key (HTTP 401, gRPC UNAUTHENTICATED)."""


@dataclass(frozen=True)
class Tenancy:
    """Maps API keys to tenants, and tenants to the prefix-cache salt."""

    tenants_by_key: Mapping[str, str] = field(default_factory=dict)

    def salt_for(self, authorization: str | None) -> bytes | None:
        """The tenant salt for an `Authorization: Bearer <key>` value; None when no keys are
        configured (everyone is one tenant). Raises Unauthenticated for a missing/unknown key."""
        if not self.tenants_by_key:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("an API key is required: send 'Authorization: Bearer <key>'")
        tenant = None
        for known, name in self.tenants_by_key.items():  # compare with every key: constant time
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                tenant = name
        if tenant is None:
            raise Unauthenticated("the API key is not valid")
        return hashlib.sha256(b"pagedserve.tenant\x00" + tenant.encode()).digest()


def build_http_api(server: GenerationServer) -> FastAPI:
    """The OpenAI-compatible routes of one replica (plus /health and /metrics)."""
    api = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None)

    @api.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body().model_dump(), error.status, headers=error.headers)

    @api.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """Unknown paths and wrong methods, in OpenAI's error shape too."""
        message = f"{request.method} {request.url.path}: {error.detail}"
        return await openai_error(request, OpenAIError(error.status_code, message))

    @api.get("/health")
    async def health() -> JSONResponse:
        problem = server.health_problem()
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "reason": problem}, 503)
        return JSONResponse({"status": "ok"})

    @api.get("/metrics")
    async def metrics() -> Response:
        text = render_prometheus({server.replica_id: server.engine.metrics()})
        return Response(text, media_type=PROMETHEUS_CONTENT_TYPE)

    @api.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        server.http_tenant_salt(request)
        card = ModelCard(
            id=server.args.served_model_name,
            created=server.created,
            max_model_len=server.frontend.max_model_len,
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        salt = server.http_tenant_salt(request)
        parsed = parse_request(await request.body(), CompletionRequest)
        server.check_model(parsed.model)
        if parsed.stream:
            events = await server.openai.stream_completion(parsed, salt)
            return StreamingResponse(events, media_type="text/event-stream")
        response = await server.openai.completion(parsed, salt)
        return JSONResponse(response.model_dump(exclude_none=True))

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        salt = server.http_tenant_salt(request)
        parsed = parse_request(await request.body(), ChatCompletionRequest)
        server.check_model(parsed.model)
        if parsed.stream:
            events = await server.openai.stream_chat(parsed, salt)
            return StreamingResponse(events, media_type="text/event-stream")
        response = await server.openai.chat(parsed, salt)
        return JSONResponse(response.model_dump(exclude_none=True))

    return api


@serve.deployment(
    name=DEPLOYMENT_NAME,
    request_router_config=RequestRouterConfig(
        request_router_class=ROUTER_CLASS_PATH,
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
    ),
)
@serve.ingress()
class GenerationServer(GrpcMethods):
    """One replica: one engine, its HTTP routes, its gRPC methods, and `generate` for handle
    callers (which the prefix-aware router routes by the prompt's block hashes)."""

    async def __init__(self, args: dict[str, Any]) -> None:
        self.args = ServeAppArgs.model_validate(args)
        config = self.args.engine_config()
        self.engine = AsyncEngine(config)
        self.tenancy = Tenancy(self.args.api_keys)
        builder = RequestBuilder(
            self.engine.request_builder.renderer, config.cache.block_size, self.args.shared_prefixes
        )
        self.frontend = FrontEnd(builder, self.engine.model_info().max_model_len)
        self.blocks = ReplicaBlocks(self.engine, builder, self.args.routing.published_blocks)
        name = self.args.served_model_name
        self.openai = OpenAIServing(self.engine, self.frontend, name)
        self.rpc = GenerationRpc(self.engine, self.frontend, name)
        self.grpc_block_size = config.cache.block_size
        self.grpc_tensor_parallel_size = config.parallel.tensor_parallel_size
        self.created = int(time.time())
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.progress = StepProgress(self.args.health.stuck_after_s)
        self._forwarded_api: FastAPI | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_api(self)

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica: stop the step loop and the workers."""
        await self.engine.shutdown()

    def health_problem(self) -> str | None:
        """Why this replica should not get traffic, or None: a dead or shut-down step loop
        (even while idle), or one that has work but stopped stepping."""
        return replica_problem(
            self.engine.health(), self.progress, self.engine.metrics(), time.monotonic()
        )

    def grpc_serving(self) -> bool:
        return self.health_problem() is None

    async def check_health(self) -> None:
        """Serve calls this periodically and replaces a replica for which it raises."""
        problem = self.health_problem()
        if problem is not None:
            raise RuntimeError(problem)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve calls this periodically; every router of this deployment receives it."""
        return self.blocks.routing_stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this periodically; the autoscaling policy receives it."""
        return autoscaling_stats(self.engine.metrics())

    async def request_block_hashes(
        self, prompt: PromptInput, authorization: str | None = None
    ) -> list[bytes]:
        """For the ingress: the prompt's block hashes for this caller's tenant, as the engine
        keys them ([] for an unknown key or a prompt it cannot render: the routed call then
        answers with the error)."""
        try:
            salt = self.tenancy.salt_for(authorization)
            request = self.frontend.builder.build(prompt, SamplingParams(), tenant_salt=salt)
            return self.engine.prompt_block_hashes(request)
        except (Unauthenticated, RequestRejected):
            return []

    async def http_call(
        self, call: HttpCall, block_hashes: list[bytes] | None = None
    ) -> AsyncIterator[HttpHead | bytes]:
        """For the ingress: runs `call` through this replica's own HTTP routes; yields the head
        (plus an `x-pagedserve-replica` header) and then the body. `block_hashes` is read by
        the router only."""
        if self._forwarded_api is None:
            self._forwarded_api = build_http_api(self)
        async for part in asgi_call(self._forwarded_api, call):
            if isinstance(part, HttpHead):
                part = HttpHead(part.status, (*part.headers, (REPLICA_HEADER, self.replica_id)))
            yield part

    async def block_hasher(self, authorization: str | None = None) -> BlockHasher:
        """How a handle caller with this API key hashes token-id prompts for routing."""
        return self.blocks.hasher(self.tenancy.salt_for(authorization))

    async def generate(
        self, request: RoutedRequest, block_hashes: list[bytes] | None = None
    ) -> AsyncIterator[RoutedOutput]:
        """Streams the engine's outputs for a handle caller; `block_hashes` is read by the router
        only. Raises Unauthenticated, RequestRejected, EngineOverloaded like the engine."""
        salt = self.tenancy.salt_for(request.authorization)
        request_id = request.request_id or f"handle-{uuid.uuid4().hex}"
        stream = self.engine.generate(
            self.frontend.builder.build(
                request.prompt, request.params, request_id=request_id, tenant_salt=salt
            )
        )
        try:
            async for output in stream:
                yield RoutedOutput(self.replica_id, output)
        finally:
            await stream.aclose()

    def http_tenant_salt(self, request: Request) -> bytes | None:
        try:
            return self.tenancy.salt_for(request.headers.get("authorization"))
        except Unauthenticated as error:
            raise authentication_error(str(error)) from None

    def grpc_tenant_salt(self, authorization: str | None) -> bytes | None:
        try:
            return self.tenancy.salt_for(authorization)
        except Unauthenticated as error:
            raise GrpcAbort(grpc.StatusCode.UNAUTHENTICATED, str(error)) from None

    def check_model(self, model: str) -> None:
        if model != self.args.served_model_name:
            raise invalid_request(
                f"The model '{model}' does not exist; this server serves "
                f"'{self.args.served_model_name}'",
                param="model",
                code="model_not_found",
            )


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application builder named by `import_path` in the Serve config; validates the
    arguments (the engine config included) before any replica starts."""
    validated = ServeAppArgs.model_validate(args)
    validated.engine_config()
    server = GenerationServer.bind(validated.model_dump())
    if validated.routing.http_ingress:
        return PrefixRoutingIngress.bind(server)
    return server
