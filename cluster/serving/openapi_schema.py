"""The OpenAPI schema of the HTTP API, published at `/openapi.json` for clients and fuzzers.

The routes read their bodies themselves (size limit first, then `parse_request`), so FastAPI
cannot infer request bodies; each POST route declares its pydantic request model here instead.

Invariant: every schema a route refers to is in `components.schemas` (the request models'
nested definitions included), so the document resolves on its own.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF_TEMPLATE = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": REF_TEMPLATE.format(model=model.__name__)}}
            },
        }
    }


def install_openapi(api: FastAPI, models: list[type[BaseModel]]) -> None:
    """Makes `api.openapi()` (served at `api.openapi_url`) include `models` and their parts."""

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            schema = get_openapi(
                title=api.title, version=api.version, routes=api.routes, description=api.description
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                model_schema = model.model_json_schema(ref_template=REF_TEMPLATE)
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            api.openapi_schema = schema
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]
