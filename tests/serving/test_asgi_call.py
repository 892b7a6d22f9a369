"""`asgi_call`, the in-process bridge a replica runs forwarded HTTP calls through: head first,
then the body in order; closing it early cancels the route; the app's errors propagate. Also
`request_prompt`, which picks the prompt the ingress hashes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from cluster.serving.ingress import HttpCall, HttpHead, asgi_call, request_prompt


def make_app(events: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse(
            {"body": body.decode(), "auth": request.headers.get("authorization")}, 201
        )

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            try:
                for i in range(1000):
                    yield f"part{i};".encode()
                    await asyncio.sleep(0.001)
                events.append("completed")
            finally:
                events.append("closed")

        return StreamingResponse(parts(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("route failed")

    return app


async def collect(app: FastAPI, call: HttpCall) -> list[HttpHead | bytes]:
    return [part async for part in asgi_call(app, call)]


def test_head_then_body_with_the_request_body_and_headers() -> None:
    call = HttpCall("POST", "/echo", (("authorization", "Bearer k"),), b"hello")
    head, *body = asyncio.run(collect(make_app([]), call))
    assert isinstance(head, HttpHead) and head.status == 201
    assert ("content-type", "application/json") in head.headers
    assert b"".join(body) == b'{"body":"hello","auth":"Bearer k"}'


def test_closing_early_cancels_the_route() -> None:
    events: list[str] = []

    async def scenario() -> list[HttpHead | bytes]:
        parts: list[HttpHead | bytes] = []
        stream = asgi_call(make_app(events), HttpCall("GET", "/stream", ()))
        async for part in stream:
            parts.append(part)
            if len(parts) == 3:
                break
        await stream.aclose()
        return parts

    head, first, second = asyncio.run(scenario())
    assert isinstance(head, HttpHead) and head.status == 200
    assert (first, second) == (b"part0;", b"part1;")
    assert events == ["closed"]  # stopped, not completed


def test_route_errors_propagate() -> None:
    app = make_app([])
    with pytest.raises(RuntimeError, match="route failed"):
        asyncio.run(collect(app, HttpCall("GET", "/boom", ())))


def test_request_prompt_reads_completions_and_chat_bodies() -> None:
    completion = b'{"model": "m", "prompt": ["first", "second"]}'
    assert request_prompt("/v1/completions", completion) == "first"
    tokens = b'{"model": "m", "prompt": [5, 6, 7]}'
    assert request_prompt("/v1/completions", tokens) == {"prompt_token_ids": [5, 6, 7]}
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    assert request_prompt("/v1/chat/completions", chat) == [{"role": "user", "content": "hi"}]
    assert request_prompt("/v1/completions", b"{not json") is None
    assert request_prompt("/v1/models", completion) is None
