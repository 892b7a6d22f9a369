"""The whole HTTP surface an ingress serves: the OpenAI routes of `http_api` (completions,
chat, models, health, metrics, LoRA admin), OpenAI's Responses API (`responses_api`),
Anthropic's Messages API (`anthropic_api`) and vLLM's tokenizer routes (`tokenize_api`), all
over the one front end.

Each call builds a new application with its own Responses store, so each ingress replica
keeps the responses it answered (see `responses_store`).
"""

from __future__ import annotations

from fastapi import FastAPI

from cluster.serving.anthropic_api import MessagesRequest, install_messages_routes
from cluster.serving.http_api import HttpIngress, build_http_api
from cluster.serving.responses_api import ResponsesRequest, install_responses_routes
from cluster.serving.responses_store import ResponseStore
from cluster.serving.tokenize_api import (
    DetokenizeRequest,
    TokenizeCompletionRequest,
    install_tokenizer_routes,
)

SURFACE_MODELS = [ResponsesRequest, MessagesRequest, TokenizeCompletionRequest, DetokenizeRequest]
"""The request bodies these routes add to the OpenAPI schema."""


def build_serving_api(ingress: HttpIngress) -> FastAPI:
    """Every HTTP route over `ingress` (see the module doc)."""
    api = build_http_api(ingress, extra_models=SURFACE_MODELS)
    install_responses_routes(api, ingress, ResponseStore())
    install_messages_routes(api, ingress)
    install_tokenizer_routes(api, ingress)
    return api
