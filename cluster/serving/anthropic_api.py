"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the
chat path (`chat_bridge`: one validation, one error table, one admission through
`FrontEnd.submit`).

Invariants:
- the API key is read from `x-api-key` (what Anthropic's clients send) or, as on every other
  route, `Authorization: Bearer`;
- every error on these routes has Anthropic's body `{"type": "error", "error": {"type",
  "message"}}` with the status the OpenAI routes would answer (400 `invalid_request_error`
  naming the field, 401, 404 `not_found_error` for an unknown model, 413, 503
  `overloaded_error` with Retry-After);
- an error after streaming began is an `error` event in that shape (Anthropic's clients raise
  it); closing the stream aborts the request;
- `count_tokens` renders exactly what `/v1/messages` would send the engine, once, and admits
  nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.serving.anthropic_events import (
    MessageEncoder,
    content_of,
    error_body,
    message_object,
    new_message_id,
    stop_reason_of,
    usage_of,
)
from cluster.serving.anthropic_requests import (
    ANTHROPIC_NAMES,
    CountTokensRequest,
    MessagesRequest,
    parse_count_tokens_request,
    parse_messages_request,
)
from cluster.serving.chat_bridge import ChatRun, chat_pieces, render_only, start_chat
from cluster.serving.error_map import ANSWERED, http_error
from cluster.serving.http_api import HttpIngress, meta_of
from cluster.serving.limits import read_body
from cluster.serving.openai_protocol import OpenAIError
from cluster.serving.openai_serving import OpenAIServing, ResponseMeta
from cluster.serving.openapi_schema import request_body
from cluster.serving.tenancy import Tenancy, Unauthenticated


def sse(event: dict[str, Any]) -> str:
    """One event, named as its `type` (Anthropic's clients read the name)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def api_key_salt(tenancy: Tenancy, request: Request) -> bytes | None:
    """The tenant salt of the key in `x-api-key` or `Authorization: Bearer`."""
    authorization = request.headers.get("authorization")
    key = request.headers.get("x-api-key")
    if key is not None and authorization is None:
        authorization = f"Bearer {key}"
    try:
        return tenancy.salt_for(authorization)
    except Unauthenticated as error:
        raise http_error(error) from None


class MessagesServing:
    """Runs Messages requests on the chat path."""

    def __init__(self, openai: OpenAIServing) -> None:
        self.openai = openai

    async def admit(
        self, request: MessagesRequest, salt: bytes | None, meta: ResponseMeta
    ) -> tuple[str, ChatRun]:
        """The message's id and its admitted chat run (the one admission of unary and
        streamed messages; refusals raised here)."""
        message_id = new_message_id()
        run = await start_chat(
            self.openai,
            request.chat_fields(),
            request_id=message_id,
            salt=salt,
            meta=meta,
            names=ANTHROPIC_NAMES,
        )
        return message_id, run

    async def create(
        self, request: MessagesRequest, salt: bytes | None, meta: ResponseMeta
    ) -> dict[str, Any]:
        message_id, run = await self.admit(request, salt, meta)
        (final,) = await self.openai.finals(run.submission.streams)
        output = final.outputs[0]
        message, reason = self.openai.assistant_message(output, run.plan, final.prompt_token_ids)
        stop_sequence = output.stop_reason if isinstance(output.stop_reason, str) else None
        usage = final.usage
        return message_object(
            message_id,
            run.submission.adapter or self.openai.model,
            content_of(message),
            stop_reason_of(reason, stop_sequence),
            stop_sequence,
            usage_of(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens),
        )

    async def stream(
        self, request: MessagesRequest, salt: bytes | None, meta: ResponseMeta
    ) -> AsyncIterator[str]:
        """Admits the request (refusals raised here, before any byte), then streams its
        events."""
        message_id, run = await self.admit(request, salt, meta)
        encoder = MessageEncoder(message_id, run.submission.adapter or self.openai.model)

        async def events() -> AsyncIterator[str]:
            try:
                async for piece in chat_pieces(run):
                    for event in encoder.feed(piece):
                        yield sse(event)
            except ANSWERED as error:
                yield sse(error_body(http_error(error)))

        return events()

    async def count_tokens(self, request: CountTokensRequest) -> dict[str, int]:
        try:
            await self.openai.frontend.adapters.resolve(request.model)
        except ANSWERED as error:
            raise http_error(error) from None
        rendered = await self.openai.frontend.off_loop(
            render_only, self.openai, request.chat_fields(), ANTHROPIC_NAMES
        )
        return {"input_tokens": len(rendered.token_ids)}


def install_messages_routes(api: FastAPI, ingress: HttpIngress) -> None:
    """The Messages routes over `ingress`'s chat serving."""
    serving = MessagesServing(ingress.openai)

    async def answer(
        request: Request, work: Callable[[bytes | None], Awaitable[Response]]
    ) -> Response:
        """Runs `work` with the caller's tenant salt; any refusal in Anthropic's error body."""
        try:
            return await work(api_key_salt(ingress.tenancy, request))
        except OpenAIError as error:
            return JSONResponse(error_body(error), error.status, headers=error.headers)

    @api.post("/v1/messages", openapi_extra=request_body(MessagesRequest))
    async def create_message(request: Request) -> Response:
        async def work(salt: bytes | None) -> Response:
            body = await read_body(request, ingress.args.limits.max_body_bytes)
            parsed = await ingress.frontend.off_loop(parse_messages_request, body)
            meta = ResponseMeta()
            if parsed.stream:
                events = await serving.stream(parsed, salt, meta)
                return StreamingResponse(
                    events, media_type="text/event-stream", headers=meta_of(meta)
                )
            return JSONResponse(await serving.create(parsed, salt, meta), headers=meta_of(meta))

        return await answer(request, work)

    @api.post("/v1/messages/count_tokens", openapi_extra=request_body(CountTokensRequest))
    async def count_tokens(request: Request) -> Response:
        async def work(salt: bytes | None) -> Response:
            body = await read_body(request, ingress.args.limits.max_body_bytes)
            parsed = await ingress.frontend.off_loop(parse_count_tokens_request, body)
            return JSONResponse(await serving.count_tokens(parsed))

        return await answer(request, work)
