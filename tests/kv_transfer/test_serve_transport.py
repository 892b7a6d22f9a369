"""`ServeKVTransport` over a stand-in deployment handle: the call it makes (method, keys, the
holder named for the router, the deployment a hint names) and how failures map to causes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.kv_transfer.payload import KVPayload, PullFailure, TransferError
from cluster.serving.kv_transport import EXPORT_METHOD, ServeKVTransport
from cluster.serving.routing import TARGET_REPLICA_KWARG


class FakeHandle:
    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[tuple[str | None, tuple[Any, ...], dict[str, Any]]] = []
        self.method: str | None = None

    def options(self, method_name: str) -> FakeHandle:
        self.method = method_name
        return self

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((self.method, args, kwargs))

        async def respond() -> Any:
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer

        return respond()


def _transport(**handles: FakeHandle) -> ServeKVTransport:
    transport = ServeKVTransport("app", "Engine")
    for name, handle in handles.items():
        transport._handles[name] = handle.options(method_name=EXPORT_METHOD)
    return transport


def test_calls_the_holders_export_on_its_deployment() -> None:
    own, prefill = FakeHandle(KVPayload("h1")), FakeHandle(KVPayload("p1"))
    transport = _transport(Engine=own, Prefill=prefill)
    assert asyncio.run(transport.fetch("h1", [b"k1", b"k2"])).holder == "h1"
    assert own.calls == [(EXPORT_METHOD, ([b"k1", b"k2"],), {TARGET_REPLICA_KWARG: "h1"})]
    assert asyncio.run(transport.fetch("p1", [b"k"], deployment="Prefill")).holder == "p1"
    assert prefill.calls == [(EXPORT_METHOD, ([b"k"],), {TARGET_REPLICA_KWARG: "p1"})]


@pytest.mark.parametrize(
    ("answer", "cause"),
    [(RuntimeError("actor died"), PullFailure.HOLDER_FAILED), ("bytes?", PullFailure.MISMATCH)],
)
def test_failures_become_a_cause(answer: Any, cause: PullFailure) -> None:
    transport = _transport(Engine=FakeHandle(answer))
    with pytest.raises(TransferError) as raised:
        asyncio.run(transport.fetch("h1", [b"k"]))
    assert raised.value.cause == cause
