"""The OpenAI-compatible HTTP routes (plus /health and /metrics), built over an `HttpIngress`:
what the routes need of whatever hosts them. `OpenAIIngress` (the Serve deployment) is the one
that serves; the same routes over an engine in one process, without Ray, are what
`benchmarks.front_end_server` measures the served path against.

Invariants (the ingress module doc has the rest):
- every error, unknown paths and wrong methods included, has OpenAI's error body;
- a body is read within `limits.max_body_bytes` and parsed on the front end's threads, never
  on the event loop;
- a response names the engine replica that served it in `x-pagedserve-replica`, when known.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.serving.app_args import ServeAppArgs
from cluster.serving.error_map import http_error
from cluster.serving.frontend import FrontEnd
from cluster.serving.limits import read_body
from cluster.serving.lora_admin import AdapterService
from cluster.serving.lora_routes import BaseModelFacts, install_lora_routes, model_cards
from cluster.serving.openai_protocol import OpenAIError
from cluster.serving.openai_requests import ChatCompletionRequest, CompletionRequest, parse_request
from cluster.serving.openai_serving import OpenAIServing, ResponseMeta
from cluster.serving.openapi_schema import install_openapi, request_body
from cluster.serving.prometheus import PROMETHEUS_CONTENT_TYPE
from cluster.serving.tenancy import Forbidden, Tenancy, Unauthenticated

REPLICA_HEADER = "x-pagedserve-replica"


class HttpIngress(Protocol):
    """What the HTTP routes read of the process that hosts them."""

    args: ServeAppArgs
    adapters: AdapterService
    frontend: FrontEnd
    openai: OpenAIServing
    created: int
    base_model: BaseModelFacts
    tenancy: Tenancy

    async def engine_problem(self) -> str | None:
        """Why the engines cannot serve now, or None (/health's answer)."""
        ...

    async def prometheus_text(self) -> tuple[str, bytes]:
        """The id of the engine replica that answered, and the metrics in Prometheus' format."""
        ...


def tenant_salt_of(tenancy: Tenancy, request: Request) -> bytes | None:
    """The tenant salt of `request`'s API key; a 401 without a valid key."""
    try:
        return tenancy.salt_for(request.headers.get("authorization"))
    except Unauthenticated as error:
        raise http_error(error) from None


def require_admin(tenancy: Tenancy, request: Request) -> None:
    """Passes for an admin key (or without API keys); 401 / 403 otherwise."""
    try:
        tenancy.authorize_admin(request.headers.get("authorization"))
    except (Unauthenticated, Forbidden) as error:
        raise http_error(error) from None


def build_http_api(ingress: HttpIngress, extra_models: Sequence[type[BaseModel]] = ()) -> FastAPI:
    """The OpenAI-compatible routes (plus /health and /metrics); `extra_models`: the request
    bodies of routes the caller adds, for the OpenAPI schema."""
    api = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_openapi(api, [CompletionRequest, ChatCompletionRequest, *extra_models])

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
        problem = await ingress.engine_problem()
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "reason": problem}, 503)
        return JSONResponse({"status": "ok"})

    @api.get("/metrics")
    async def metrics(request: Request) -> Response:
        access = ingress.args.limits.metrics.access
        if access == "port":
            raise OpenAIError(404, "GET /metrics: served on the metrics port only")
        if access == "api_key":
            tenant_salt_of(ingress.tenancy, request)
        replica_id, text = await ingress.prometheus_text()
        headers = {REPLICA_HEADER: replica_id}
        return Response(text, media_type=PROMETHEUS_CONTENT_TYPE, headers=headers)

    @api.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        tenant_salt_of(ingress.tenancy, request)
        await ingress.adapters.list_loras()  # refreshes the view from the registry
        cards = model_cards(ingress.adapters, ingress.created, ingress.base_model)
        return JSONResponse(cards.model_dump())

    async def run(request: Request, model: type[Any], unary: Any, stream: Any) -> Response:
        """Authenticate, read and parse the body off the loop, check the model, then answer
        with one JSON body (`unary`) or server-sent events (`stream`)."""
        salt = tenant_salt_of(ingress.tenancy, request)
        body = await read_body(request, ingress.args.limits.max_body_bytes)
        parsed = await ingress.frontend.off_loop(parse_request, body, model)
        meta = ResponseMeta()
        if parsed.stream:
            events = await stream(parsed, salt, meta)
            return StreamingResponse(events, media_type="text/event-stream", headers=meta_of(meta))
        response = await unary(parsed, salt, meta)
        return JSONResponse(response.model_dump(exclude_none=True), headers=meta_of(meta))

    @api.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        openai = ingress.openai
        return await run(request, CompletionRequest, openai.completion, openai.stream_completion)

    @api.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        openai = ingress.openai
        return await run(request, ChatCompletionRequest, openai.chat, openai.stream_chat)

    if ingress.args.allow_runtime_lora_updating:
        install_lora_routes(
            api,
            ingress.adapters,
            functools.partial(require_admin, ingress.tenancy),
            ingress.args.limits.max_body_bytes,
        )
    return api


def meta_of(meta: ResponseMeta) -> dict[str, str]:
    return {REPLICA_HEADER: meta.served_by} if meta.served_by else {}
