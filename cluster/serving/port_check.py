"""Refusing to start on a port another process listens on, before anything is loaded.

Serve's HTTP proxy and gRPC server bind their ports with SO_REUSEPORT, so a second
`pagedserve serve` on a port in use would come up beside the first and the kernel would split
the connections between the two. `check_ports_free` binds each port the way a plain server
does (SO_REUSEADDR, so connections in TIME_WAIT do not count, and no SO_REUSEPORT, so a
listener does) and refuses with one ConfigError naming the port, the flag that sets it and,
where the system lets us see it, the process that holds it: what uvicorn, vLLM and
llama-server do.

Invariant: the check binds and closes at once; it never listens, so it cannot take a
connection meant for the other process.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from dataclasses import dataclass

import psutil

from cluster.engine.errors import ConfigError

GRPC_BIND_HOST = "::"
"""Where Serve's gRPC server listens (every address, IPv6 and IPv4)."""


@dataclass(frozen=True)
class ServedPort:
    """A port `pagedserve serve` will listen on: which API, the flag that sets it, the host."""

    api: str
    flag: str
    host: str
    port: int


def bind_error(host: str, port: int) -> OSError | None:
    """The error binding `host`:`port` as a plain listener would meet, or None when free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        if family == socket.AF_INET6:  # no IPv6 on this machine: every IPv4 address
            return bind_error("0.0.0.0", port)
        raise
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            sock.bind((host, port))
        except OSError as error:
            return error
    return None


def port_holder(port: int) -> str | None:
    """'pid N (command line)' of a process listening on TCP `port`, or None when the system
    does not say (another user's process without the rights to see it)."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for connection in connections:
        if connection.status != psutil.CONN_LISTEN or connection.laddr.port != port:
            continue
        if connection.pid is None:
            continue
        try:
            command = " ".join(psutil.Process(connection.pid).cmdline())
        except psutil.Error:
            return f"pid {connection.pid}"
        return f"pid {connection.pid} ({command[:200]})"
    return None


def check_ports_free(ports: list[ServedPort]) -> None:
    """Raises ConfigError for the first of `ports` another process holds (port 0, "any
    free port", is never checked)."""
    for served in ports:
        if served.port == 0:
            continue
        error = bind_error(served.host, served.port)
        if error is None:
            continue
        if error.errno == errno.EADDRINUSE:
            holder = port_holder(served.port)
            held_by = f" by {holder}" if holder else " by another process"
            raise ConfigError(
                f"{served.api} port {served.port} is already in use{held_by}: stop it or "
                f"choose another port with {served.flag}"
            )
        raise ConfigError(
            f"{served.api} port {served.port} cannot be bound on {served.host}: "
            f"{error.strerror or error}"
        )
