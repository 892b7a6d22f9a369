"""`POST /v1/responses`, `GET /v1/responses/{id}` and `DELETE /v1/responses/{id}`: OpenAI's
Responses API over the chat path (`chat_bridge`: one validation, one error table, one
admission through `FrontEnd.submit`).

Invariants:
- every refusal before the first byte is a 400/404/503 with OpenAI's error body, its `param`
  in the Responses API's names (`input`, `max_output_tokens`, `text.format.schema`);
- an error after streaming began is an `error` event carrying OpenAI's error body (the
  `openai` client raises it); closing the stream aborts the request;
- a response with `store` true (the default) is kept in the ingress replica's bounded store
  (`responses_store`) under the caller's tenant once it finished, so `previous_response_id`
  continues its conversation (its input and output, not its `instructions`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.serving.chat_bridge import ChatRun, chat_pieces, start_chat
from cluster.serving.error_map import ANSWERED, http_error
from cluster.serving.http_api import HttpIngress, meta_of, tenant_salt_of
from cluster.serving.limits import read_body
from cluster.serving.openai_protocol import OpenAIError, invalid_request
from cluster.serving.openai_serving import OpenAIServing, ResponseMeta
from cluster.serving.openapi_schema import request_body
from cluster.serving.responses_events import (
    ResponseEncoder,
    new_id,
    output_of,
    response_object,
    usage_of,
)
from cluster.serving.responses_requests import (
    ITEM_MODELS,
    RESPONSES_NAMES,
    ResponsesRequest,
    conversation_of,
    parse_responses_request,
)
from cluster.serving.responses_store import ResponseStore, StoredResponse


def sse(event: dict[str, Any]) -> str:
    """One typed server-sent event, named as its `type` (as OpenAI streams them)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def assistant_turn(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages that continue its conversation."""
    return conversation_of([ITEM_MODELS[item["type"]].model_validate(item) for item in output])


class ResponsesServing:
    """Runs Responses requests on the chat path and keeps stored ones (see the module doc)."""

    def __init__(self, openai: OpenAIServing, store: ResponseStore) -> None:
        self.openai = openai
        self.store = store

    def conversation(self, request: ResponsesRequest, salt: bytes | None) -> list[dict]:
        """The request's messages after the conversation `previous_response_id` names (a 400
        when this replica holds no such response for the tenant)."""
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self.store.get(salt, request.previous_response_id)
            if stored is None:
                raise invalid_request(
                    f"Previous response with id '{request.previous_response_id}' not found.",
                    "previous_response_id",
                )
            history = stored.conversation
        return request.conversation(history)

    def keep(
        self,
        request: ResponsesRequest,
        salt: bytes | None,
        conversation: list[dict[str, Any]],
        body: dict[str, Any],
    ) -> None:
        if request.store:
            turn = conversation + assistant_turn(body["output"])
            self.store.put(salt, body["id"], StoredResponse(body, turn))

    async def admit(
        self, request: ResponsesRequest, salt: bytes | None, meta: ResponseMeta
    ) -> tuple[str, list[dict[str, Any]], ChatRun]:
        """The response's id, the conversation it continues and its admitted chat run (the
        one admission of unary and streamed responses; refusals raised here)."""
        response_id = new_id("resp")
        conversation = self.conversation(request, salt)
        run = await start_chat(
            self.openai,
            request.chat_fields(conversation),
            request_id=response_id,
            salt=salt,
            meta=meta,
            names=RESPONSES_NAMES,
        )
        return response_id, conversation, run

    async def create(
        self, request: ResponsesRequest, salt: bytes | None, meta: ResponseMeta
    ) -> dict[str, Any]:
        response_id, conversation, run = await self.admit(request, salt, meta)
        (final,) = await self.openai.finals(run.submission.streams)
        message, reason = self.openai.assistant_message(
            final.outputs[0], run.plan, final.prompt_token_ids
        )
        usage = final.usage
        body = response_object(
            request,
            run.params,
            response_id=response_id,
            created_at=int(time.time()),
            model=run.submission.adapter or self.openai.model,
            output=output_of(message),
            finish=reason,
            usage=usage_of(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens),
        )
        self.keep(request, salt, conversation, body)
        return body

    async def stream(
        self, request: ResponsesRequest, salt: bytes | None, meta: ResponseMeta
    ) -> AsyncIterator[str]:
        """Admits the request (refusals raised here, before any byte), then streams its
        events."""
        response_id, conversation, run = await self.admit(request, salt, meta)
        encoder = ResponseEncoder(
            request, run.params, response_id, run.submission.adapter or self.openai.model
        )

        async def events() -> AsyncIterator[str]:
            for event in encoder.start():
                yield sse(event)
            try:
                async for piece in chat_pieces(run):
                    for event in encoder.feed(piece):
                        yield sse(event)
            except ANSWERED as error:
                body = http_error(error).body().model_dump()
                yield sse(
                    {
                        "type": "error",
                        "sequence_number": encoder.sequence,
                        "code": body["error"]["code"],
                        "message": body["error"]["message"],
                        "param": None,
                        "error": body["error"],  # what the `openai` client raises on
                    }
                )
                return
            self.keep(request, salt, conversation, encoder.response_body)

        return events()

    def stored(self, salt: bytes | None, response_id: str) -> dict[str, Any]:
        stored = self.store.get(salt, response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.body

    def delete(self, salt: bytes | None, response_id: str) -> dict[str, Any]:
        if not self.store.delete(salt, response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(
        404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found"
    )


def install_responses_routes(api: FastAPI, ingress: HttpIngress, store: ResponseStore) -> None:
    """The Responses routes over `ingress`'s chat serving, keeping responses in `store`."""
    serving = ResponsesServing(ingress.openai, store)

    @api.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
    async def create_response(request: Request) -> Response:
        salt = tenant_salt_of(ingress.tenancy, request)
        body = await read_body(request, ingress.args.limits.max_body_bytes)
        parsed = await ingress.frontend.off_loop(parse_responses_request, body)
        meta = ResponseMeta()
        if parsed.stream:
            events = await serving.stream(parsed, salt, meta)
            return StreamingResponse(events, media_type="text/event-stream", headers=meta_of(meta))
        return JSONResponse(await serving.create(parsed, salt, meta), headers=meta_of(meta))

    @api.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> JSONResponse:
        salt = tenant_salt_of(ingress.tenancy, request)
        return JSONResponse(serving.stored(salt, response_id))

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> JSONResponse:
        salt = tenant_salt_of(ingress.tenancy, request)
        return JSONResponse(serving.delete(salt, response_id))
