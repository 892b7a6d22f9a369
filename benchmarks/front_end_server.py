"""The served path without Ray: the ingress's OpenAI HTTP routes (`cluster.serving.http_api`,
the same parsing, rendering, streaming and errors) over the replica's `AsyncEngine`, all in one
process under uvicorn. It is the lower bound of any served topology, against which
`benchmarks.served_overhead` splits the served path's cost into what HTTP, SSE and the client
cost and what Ray Serve's processes and hops cost.

``python -m benchmarks.front_end_server --port P [--host H] [--serve-args FLAGS...]`` serves the
application `pagedserve serve FLAGS` would deploy (the shipped Serve config's by default: its
engine, stream settings, limits and API keys) until interrupted. A benchmark
harness, not a deployment: one engine, no routing, no KV directory, no LoRA registry, no drain.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.generate_request import GenerateRequest, RequestBuilder
from cluster.engine.output_stream import RequestDelta
from cluster.engine.tokenization import PromptRenderer
from cluster.serving.api_surface import build_serving_api
from cluster.serving.app_args import ServeAppArgs
from cluster.serving.cli_serve import served_app_args
from cluster.serving.engine_server import stream_as_replica
from cluster.serving.frontend import FrontEnd
from cluster.serving.lora_admin import AdapterService
from cluster.serving.lora_routes import BaseModelFacts
from cluster.serving.openai_serving import OpenAIServing
from cluster.serving.prometheus import render_prometheus
from cluster.serving.reasoning_parsers import reasoning_tags
from cluster.serving.tenancy import Tenancy
from cluster.serving.tool_calls import ToolSettings

REPLICA_ID = "in-process"


class StreamingEngine:
    """An `EngineClient` over the in-process engine, streaming as an engine replica does (the
    application's `stream_interval` and `stream_chunks_per_step`)."""

    def __init__(self, engine: AsyncEngine, args: ServeAppArgs) -> None:
        self.engine = engine
        self.args = args

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        return stream_as_replica(self.engine, request, self.args, REPLICA_ID)


class LocalIngress:
    """An `HttpIngress` over one `AsyncEngine` in this process (see the module doc)."""

    def __init__(self, engine: AsyncEngine, args: ServeAppArgs) -> None:
        self.engine = engine
        self.args = args
        info = engine.model_info()
        renderer = PromptRenderer(engine.request_builder.renderer.tokenizer, info.vocab_size)
        block_size = engine.core.request_keys.block_size
        builder = RequestBuilder(renderer, block_size, args.shared_prefixes)
        self.tenancy = Tenancy(args.tenants_by_key(), args.admin_keys())
        self.adapters = AdapterService(args.served_model_name, None)
        self.frontend = FrontEnd(
            builder,
            info.max_model_len,
            StreamingEngine(engine, args),
            self.adapters,
            generation_defaults=engine.core.generation_defaults,
        )
        tools = ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser)
        reasoning = reasoning_tags(args.reasoning_parser)
        self.openai = OpenAIServing(self.frontend, args.served_model_name, tools, reasoning)
        self.created = int(time.time())
        model = args.engine_config().model.model
        self.base_model = BaseModelFacts(model, info.max_model_len, info.architecture)

    async def engine_problem(self) -> str | None:
        health = self.engine.health()
        return None if health.alive else (health.error or "the engine is not running")

    async def prometheus_text(self) -> tuple[str, bytes]:
        return REPLICA_ID, render_prometheus({REPLICA_ID: self.engine.metrics()})


@contextlib.asynccontextmanager
async def local_ingress(args: ServeAppArgs) -> AsyncIterator[LocalIngress]:
    """A `LocalIngress` over a new engine, shut down on exit."""
    engine = await AsyncEngine.create(args.engine_config())
    ingress = LocalIngress(engine, args)
    try:
        await ingress.adapters.start()
        yield ingress
    finally:
        await ingress.adapters.close()
        await engine.shutdown()


def build_app(args: ServeAppArgs) -> FastAPI:
    """The HTTP application, its engine started and stopped with it (uvicorn's lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with local_ingress(args) as ingress:
            app.mount("/", build_serving_api(ingress))
            yield

    return FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--serve-args", nargs=argparse.REMAINDER, default=[], help="`serve` flags (last)"
    )
    args = parser.parse_args(argv)
    app = build_app(served_app_args(args.serve_args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
