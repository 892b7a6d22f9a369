"""The servicer functions Serve's gRPC proxy registers (`grpc_options.grpc_servicer_functions`):
the generated ones, with request deserializers that never raise.

Serve's proxy keeps each method's `request_deserializer` and parses the request bytes before it
routes the call to the ingress. grpcio answers a deserializer that raises with UNKNOWN
("Exception deserializing request!"), and the application never sees the call. Here a message
that does not parse becomes a `CorruptRequest` instead, which the ingress method refuses with
INVALID_ARGUMENT (`grpc_validation.parse_or_abort`).

Registering also installs `grpc_proxy_cancel` in the proxy's process: a client's cancel always
reaches the replica (Serve's proxy lost those that landed while it wrote a message).

Invariant: valid bytes deserialize exactly as the generated code does (same message type).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2_grpc

from cluster.serving import grpc_proxy_cancel
from cluster.serving.grpc_validation import CorruptRequest
from protos import generation_pb2_grpc

Deserializer = Callable[[bytes], Any]


@dataclass(frozen=True)
class LenientDeserializer:
    """Parses like `parse`; bytes that are not a valid message become a `CorruptRequest`."""

    parse: Deserializer

    def __call__(self, data: bytes) -> Any:
        try:
            return self.parse(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as error:
            owner = getattr(self.parse, "__self__", None)
            descriptor = getattr(owner, "DESCRIPTOR", None)
            name = getattr(descriptor, "full_name", "request")
            return CorruptRequest(name, f"{type(error).__name__}: {error}")


def lenient(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_deserializer is None:
        return handler
    return handler._replace(request_deserializer=LenientDeserializer(handler.request_deserializer))


@dataclass
class _Captured:
    """Stands in for the server while a generated servicer function registers its handlers."""

    services: dict[str, dict[str, grpc.RpcMethodHandler]] = field(default_factory=dict)

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """The generated code registers the same handlers by name too (kept below)."""

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.services[service] = handlers


def register_leniently(
    add_servicer: Callable[[Any, Any], None], servicer: Any, server: Any
) -> None:
    """Registers what the generated `add_servicer` would, with lenient deserializers."""
    grpc_proxy_cancel.install()  # this runs in Serve's proxy process
    captured = _Captured()
    add_servicer(servicer, captured)
    for service, handlers in captured.services.items():
        wrapped = {name: lenient(handler) for name, handler in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        add_registered = getattr(server, "add_registered_method_handlers", None)
        if add_registered is not None:
            add_registered(service, wrapped)


def add_GenerationServicer_to_server(servicer: Any, server: Any) -> None:
    """`pagedserve.v1.Generation`, as generated, with corrupt requests INVALID_ARGUMENT."""
    register_leniently(generation_pb2_grpc.add_GenerationServicer_to_server, servicer, server)


def add_HealthServicer_to_server(servicer: Any, server: Any) -> None:
    """`grpc.health.v1.Health`, as generated, with corrupt requests INVALID_ARGUMENT."""
    register_leniently(health_pb2_grpc.add_HealthServicer_to_server, servicer, server)
