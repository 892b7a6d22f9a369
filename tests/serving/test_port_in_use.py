"""`pagedserve serve` on a port another process listens on refuses to start: a clear error
naming the port, the flag and the holder, exit status 2, before any model is looked at.

The holder listens with SO_REUSEPORT, as Serve's own proxies do: the case where a second
server would otherwise come up beside the first and share its connections. The model named
does not exist, so a check that ran after the model's would fail with another message."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from benchmarks.ports import free_port
from cluster.engine.errors import ConfigError
from cluster.serving.cli import main
from cluster.serving.port_check import ServedPort, check_ports_free


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port this process listens on with SO_REUSEPORT (every address)."""
    port = free_port()
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("0.0.0.0", port))
        holder.listen()
        yield port


@pytest.mark.parametrize(
    ("api", "flag", "other_flag"),
    [("HTTP", "--port", "--grpc-port"), ("gRPC", "--grpc-port", "--port")],
)
def test_serve_refuses_a_port_in_use_naming_it_and_its_holder(
    held_port: int, api: str, flag: str, other_flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "/no/such/model.gguf", flag, str(held_port), other_flag, str(free_port())]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{api} port {held_port} is already in use" in err, err
    assert f"pid {os.getpid()}" in err  # the holder, found by its listening socket
    assert f"choose another port with {flag}" in err
    assert "no/such/model" not in err  # refused before the model was looked at


def test_a_free_port_and_port_zero_pass() -> None:
    check_ports_free(
        [
            ServedPort("HTTP", "--port", "127.0.0.1", free_port()),
            ServedPort("gRPC", "--grpc-port", "::", 0),
        ]
    )


def test_a_listener_on_loopback_blocks_every_address() -> None:
    with socket.socket() as loopback:
        port = free_port()
        loopback.bind(("127.0.0.1", port))
        loopback.listen()
        with pytest.raises(ConfigError, match=f"gRPC port {port} is already in use"):
            check_ports_free([ServedPort("gRPC", "--grpc-port", "::", port)])
