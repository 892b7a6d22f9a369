"""LoRA over HTTP: `/v1/models` with the adapters, `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` (vLLM's routes, bodies and answers), and the error mapping both
front ends share for adapters.

Invariants:
- the load and unload routes exist only with `allow_runtime_lora_updating: true`; otherwise
  they answer 404 like any unknown path (as vLLM without `VLLM_ALLOW_RUNTIME_LORA_UPDATING`);
- with API keys configured they need an admin key: 401 without a valid key, 403 with a key
  that is not an admin's, checked before the body is read;
- success is 200 with vLLM's plain-text message; a bad body, a malformed, oversized-rank or
  wrong-shape adapter, or a name already loaded from another path is a 400 naming the problem;
  unloading an unknown name is a 404; every error has OpenAI's error body.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from cluster.engine.errors import AdapterNotFound, EngineDead, RequestRejected
from cluster.engine.lora_request import LoRARequest
from cluster.serving.limits import read_body
from cluster.serving.lora_admin import AdapterService
from cluster.serving.openai_protocol import (
    ModelCard,
    ModelList,
    OpenAIError,
    invalid_request,
    parse_object,
)
from cluster.serving.openapi_schema import request_body

MAX_ADMIN_BODY_BYTES = 64 * 1024
PLACEHOLDER_INT_ID = 1
"""The registry assigns each adapter's integer id; a request's own is ignored (vLLM's too)."""


class _AdminBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class LoadLoRAAdapterRequest(_AdminBody):
    lora_name: str = Field(min_length=1, max_length=256, pattern=r"^\S+$")
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_AdminBody):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def adapter_http_error(error: RequestRejected | EngineDead) -> OpenAIError:
    """The HTTP error for an adapter operation's failure (EngineDead: no replica confirmed)."""
    if isinstance(error, AdapterNotFound):
        return OpenAIError(404, str(error), error_type="NotFoundError", param="lora_name")
    if isinstance(error, RequestRejected):  # InvalidAdapter, LoRA off
        return invalid_request(str(error), param="lora_path")
    return OpenAIError(503, str(error), error_type="server_error", code="engine_unavailable")


@dataclass(frozen=True)
class BaseModelFacts:
    """What `/v1/models` says of the base model: where it was loaded from (its `root`, the
    engine's `model.model`), its context and its architecture (ours, e.g. `qwen3_moe`). An
    adapter runs on the base model, so its card repeats the context and the architecture."""

    root: str
    max_model_len: int
    architecture: str


def model_cards(adapters: AdapterService, created: int, base_model: BaseModelFacts) -> ModelList:
    """The base model, then each adapter with its path (`root`) and base model (`parent`)."""
    base = adapters.base_model
    shared = {
        "created": created,
        "max_model_len": base_model.max_model_len,
        "architecture": base_model.architecture,
    }
    cards = [ModelCard(id=base, root=base_model.root, **shared)]
    for adapter in adapters.view.adapters:
        cards.append(
            ModelCard(
                id=adapter.lora_name,
                root=adapter.lora_path,
                parent=adapter.base_model_name or base,
                **shared,
            )
        )
    return ModelList(data=cards)


def install_lora_routes(
    api: FastAPI,
    adapters: AdapterService,
    authorize_admin: Callable[[Request], None],
    max_body_bytes: int,
) -> None:
    """Adds the load and unload routes (only call it when runtime updating is allowed);
    `authorize_admin` raises the 401/403 OpenAIError for a caller that may not use them."""
    limit = min(max_body_bytes, MAX_ADMIN_BODY_BYTES)

    @api.post("/v1/load_lora_adapter", openapi_extra=request_body(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        authorize_admin(request)
        body = parse_object(await read_body(request, limit), LoadLoRAAdapterRequest)
        if body.lora_name == adapters.base_model:
            raise invalid_request(f"'{body.lora_name}' is the base model's name", param="lora_name")
        lora = LoRARequest(body.lora_name, PLACEHOLDER_INT_ID, body.lora_path, adapters.base_model)
        try:
            await adapters.add_lora(lora)
        except (RequestRejected, EngineDead) as error:
            raise adapter_http_error(error) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @api.post("/v1/unload_lora_adapter", openapi_extra=request_body(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        authorize_admin(request)
        body = parse_object(await read_body(request, limit), UnloadLoRAAdapterRequest)
        try:
            await adapters.remove_lora(body.lora_name)
        except (RequestRejected, EngineDead) as error:
            raise adapter_http_error(error) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
