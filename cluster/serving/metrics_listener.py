"""`/metrics` on a separate port (`limits.metrics.access: port`): a minimal HTTP listener an
ingress replica runs beside the API, for a network only Prometheus reaches.

Invariants: it answers `GET /metrics` with the Prometheus text and anything else with 404; it
reads at most one request head of `MAX_HEAD_BYTES` per connection and never a body.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from cluster.serving.prometheus import PROMETHEUS_CONTENT_TYPE

MAX_HEAD_BYTES = 8192
READ_TIMEOUT_S = 5.0

RenderMetrics = Callable[[], Awaitable[bytes]]


def _response(status: str, content_type: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class MetricsListener:
    """Serves `render()` at `GET /metrics` on `host:port` until `close()`."""

    def __init__(self, render: RenderMetrics, host: str, port: int) -> None:
        self.render = render
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=MAX_HEAD_BYTES
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                request_line = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
            method, _, rest = request_line.decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if method == "GET" and path == "/metrics":
                text = await self.render()
                writer.write(_response("200 OK", PROMETHEUS_CONTENT_TYPE, text))
            else:
                writer.write(_response("404 Not Found", "text/plain", b"not found\n"))
            await writer.drain()
        except (TimeoutError, ValueError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
