"""Prefix-routed HTTP: an ingress deployment in front of the engine deployment.

Serve's HTTP proxy picks a replica before the request body is read, so it cannot route by the
prompt. With `routing.http_ingress: true` the application's HTTP entry is `PrefixRoutingIngress`
instead: it reads the body, gets the prompt's block hashes (rendered, tokenized and hashed by the
engine's own code on some replica, `GenerationServer.request_block_hashes`), then calls the engine
deployment's `http_call` through a handle with those hashes, so `PrefixAwareRouter` sends it to
the replica that holds the longest prefix. The routed replica runs the call through its own
OpenAI routes (`asgi_call`, the same FastAPI app its direct HTTP uses), so responses, errors and
streaming are byte-for-byte those of a direct call.

Invariants:
- the first part of every `http_call` stream is an `HttpHead`, then body chunks in order;
- closing the stream (a client disconnect at the ingress) cancels the route on the replica,
  which closes the engine stream and so aborts the request and frees its blocks;
- the ingress derives nothing about tenants: the replicas authenticate and salt as they do for
  direct calls (a bad key gets no hashes and then the replica's 401).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import StreamingResponse

from cluster.engine.generate_request import PromptInput
from cluster.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    parse_request,
)
from cluster.serving.openai_serving import engine_prompt
from cluster.serving.routing import BLOCK_HASHES_KWARG

INGRESS_NAME = "PrefixRoutingIngress"
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
AsgiMessage = MutableMapping[str, Any]
AsgiApp = Callable[
    [AsgiMessage, Callable[[], Awaitable[AsgiMessage]], Callable[[AsgiMessage], Awaitable[None]]],
    Awaitable[None],
]


@dataclass(frozen=True)
class HttpCall:
    """An HTTP request as the ingress forwards it (headers lower-cased, only those the routes
    read)."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes = b""
    query_string: bytes = b""

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(frozen=True)
class HttpHead:
    """The status and headers of a forwarded response (its first stream part)."""

    status: int
    headers: tuple[tuple[str, str], ...]


def request_prompt(path: str, body: bytes) -> PromptInput | None:
    """The (first) prompt of an OpenAI completions or chat body, or None when the body is not
    one (the routed replica then answers with the proper error)."""
    try:
        if path == COMPLETIONS_PATH:
            prompts = parse_request(body, CompletionRequest).prompts()
            return engine_prompt(prompts[0]) if prompts else None
        if path == CHAT_PATH:
            return parse_request(body, ChatCompletionRequest).chat_messages()
    except OpenAIError:
        return None
    return None


async def asgi_call(app: AsgiApp, call: HttpCall) -> AsyncIterator[HttpHead | bytes]:
    """Runs `call` through an ASGI app in this process: yields the `HttpHead`, then each
    non-empty body chunk. Closing the iterator cancels the app (seen as a client disconnect)."""
    messages: asyncio.Queue[AsgiMessage | None] = asyncio.Queue()
    delivered = False

    async def receive() -> AsgiMessage:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects on its own; cancel does
        return {"type": "http.disconnect"}

    async def send(message: AsgiMessage) -> None:
        await messages.put(message)

    scope: AsgiMessage = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "root_path": "",
        "query_string": call.query_string,
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in call.headers],
        "client": None,
        "server": None,
    }

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            messages.put_nowait(None)

    task = asyncio.get_running_loop().create_task(run())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                headers = tuple(
                    (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]
                )
                yield HttpHead(int(message["status"]), headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task  # re-raises what the app raised, if anything
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def http_call_of(request: Request) -> HttpCall:
    """The forwarded form of an incoming request (path relative to the app's route prefix)."""
    headers = tuple(
        (name, value)
        for name in FORWARDED_HEADERS
        if (value := request.headers.get(name)) is not None
    )
    path, root = request.scope["path"], request.scope.get("root_path", "")
    if root and path.startswith(root):  # Serve keeps the route prefix in the path
        path = path[len(root) :] or "/"
    return HttpCall(request.method, path, headers, await request.body(), request.url.query.encode())


@serve.deployment(name=INGRESS_NAME)
class PrefixRoutingIngress:
    """The HTTP entry of a prefix-routed application (see the module doc). A plain Serve HTTP
    deployment (not FastAPI: Serve allows one FastAPI ingress per application, the replicas')."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def __call__(self, request: Request) -> StreamingResponse:
        return await self.forward(await http_call_of(request))

    async def block_hashes(self, call: HttpCall) -> list[bytes]:
        prompt = request_prompt(call.path, call.body) if call.method == "POST" else None
        if prompt is None:
            return []
        hashes: list[bytes] = await self.engine.request_block_hashes.remote(
            prompt, call.header("authorization")
        )
        return hashes

    async def forward(self, call: HttpCall) -> StreamingResponse:
        hashes = await self.block_hashes(call)
        stream = self.engine.options(stream=True).http_call.remote(
            call, **{BLOCK_HASHES_KWARG: hashes}
        )
        head = await anext(stream)
        if not isinstance(head, HttpHead):
            raise TypeError(f"http_call must start with an HttpHead, got {type(head).__name__}")
        headers = {k: v for k, v in head.headers if k.lower() != "content-length"}
        return StreamingResponse(
            _body(stream), status_code=head.status, headers=headers, media_type=None
        )


async def _body(stream: Any) -> AsyncIterator[bytes]:
    """The body parts; a client that goes away cancels the replica's call (and so its request)."""
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    finally:
        if not finished:
            stream.cancel()
