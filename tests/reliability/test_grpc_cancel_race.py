"""The gRPC "lost cancel", reproduced deterministically without a server.

Serve's gRPC proxy (`gRPCProxy.send_request_to_replica` over `ProxyResponseGenerator`) cancels
the handle's response only when the client's cancel reaches it while it awaits the replica's
next message. When the cancel lands while a message is being written, its generator is closed
at `yield result`; it swallows that (`except BaseException`) and never cancels the response, so
the request runs on to its end. `proxy_shaped_send` keeps exactly that shape;
`grpc_proxy_cancel.cancel_on_close` cancels the response whenever the stream is closed early.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from cluster.serving.grpc_proxy_cancel import (
    PATCHED_FLAG,
    PATCHED_RAY,
    RecordingHandle,
    cancel_on_close,
    install,
)


class Response:
    """A streaming handle response: `length` messages, 10 ms apart."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.sent = 0
        self.cancelled = False

    async def next(self) -> int:
        if self.cancelled:
            raise asyncio.CancelledError
        await asyncio.sleep(0.01)
        if self.sent == self.length:
            raise StopAsyncIteration
        self.sent += 1
        return self.sent

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    def __init__(self, length: int = 1000) -> None:
        self.length = length
        self.responses: list[Response] = []

    def remote(self, *args: Any) -> Response:
        self.responses.append(Response(self.length))
        return self.responses[-1]


async def proxy_shaped_send(self: Any, *, handle: Any, request: str) -> AsyncIterator[Any]:
    """`send_request_to_replica`'s shape: cancels only on a CancelledError in the await."""
    response = handle.remote(request)
    try:
        while True:
            try:
                result = await response.next()
            except asyncio.CancelledError:
                response.cancel()  # ProxyResponseGenerator.__anext__
                raise
            except StopAsyncIteration:
                break
            yield result
        status = "OK"
    except BaseException:
        status = "CANCELLED"
    yield status


async def close_while_writing(send: Any, handle: Handle) -> None:
    """What grpc does when the client cancels while a message is being written: the proxy's
    generator, suspended at its `yield`, is closed."""
    messages = send(None, handle=handle, request="r")
    assert await anext(messages) == 1
    with contextlib.suppress(RuntimeError):  # the proxy's generator ignores GeneratorExit
        await messages.aclose()


def test_the_proxy_shape_loses_a_cancel_that_lands_while_a_message_is_written() -> None:
    handle = Handle()
    asyncio.run(close_while_writing(proxy_shaped_send, handle))
    assert not handle.responses[0].cancelled  # the race: the replica's call runs to its end


def test_cancel_on_close_cancels_the_response_of_a_stream_closed_while_writing() -> None:
    handle = Handle()
    asyncio.run(close_while_writing(cancel_on_close(proxy_shaped_send), handle))
    assert handle.responses[0].cancelled


def test_cancel_on_close_leaves_a_finished_stream_alone_and_keeps_its_messages() -> None:
    handle = Handle(length=3)

    async def collect() -> list[Any]:
        send = cancel_on_close(proxy_shaped_send)
        return [m async for m in send(None, handle=handle, request="r")]

    assert asyncio.run(collect()) == [1, 2, 3, "OK"]
    assert not handle.responses[0].cancelled


def test_recording_handle_options_share_the_record_and_cancel_tolerates_errors() -> None:
    class Failing:
        def cancel(self) -> None:
            raise RuntimeError("routing failed")

    class Inner:
        def options(self, **_: Any) -> Inner:
            return self

        def remote(self) -> Failing:
            return Failing()

    recording = RecordingHandle(Inner())
    recording.options(stream=True).remote()
    assert len(recording.responses) == 1
    recording.cancel_all()  # does not raise


def test_install_wraps_the_proxy_once() -> None:
    from ray.serve._private.proxy import gRPCProxy

    assert install() and install()
    send = gRPCProxy.send_request_to_replica
    assert getattr(send, PATCHED_FLAG)
    install()
    assert gRPCProxy.send_request_to_replica is send


def test_the_patched_ray_range_is_the_one_pyproject_pins_and_another_ray_is_left_alone(
    monkeypatch: Any,
) -> None:
    import pathlib
    import tomllib

    import ray

    pyproject = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    (pin,) = [d for d in dependencies if d.startswith("ray[")]
    (first, end) = PATCHED_RAY
    assert pin == f"ray[serve]>={first[0]}.{first[1]},<{end[0]}.{end[1]}"
    monkeypatch.setattr(ray, "__version__", f"{end[0]}.{end[1]}.0")
    assert not install()
