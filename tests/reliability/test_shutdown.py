"""Shutdown under load: `pagedserve serve` started as a subprocess with the
tiny model, streams in flight, then SIGTERM (what Kubernetes sends) or SIGINT (Ctrl-C).

Either signal, to the server or (SIGTERM) to its whole process group, must stop new work at
once (a JSON 503 with Retry-After), let the streams in flight finish within the grace period or
else end each with an OpenAI error event and `[DONE]` (never cut), shut Ray down and exit 0,
with no native stack trace and none of its processes left. Each test starts its own server
(about 20 s) and bounds every wait.
"""

from __future__ import annotations

import pathlib
import signal
import socket
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from benchmarks.reliability_probes import shutdown_under_load
from benchmarks.reliability_server import LocalServer, derived_config, tiny_engine

pytestmark = [pytest.mark.ray, pytest.mark.own_ray]

EXIT_BOUND_S = 30.0
"""Seconds past the grace period the process may take to stop Serve and Ray and exit."""


def one_long_stream_at_a_time(engine: dict[str, Any]) -> dict[str, Any]:
    """The tiny engine running one sequence at a time, up to its 1024 positions: streams that
    cannot all finish within a second, however fast the machine (see the SIGINT test)."""
    engine["model"]["max_model_len"] = 1024
    engine["scheduler"]["max_num_seqs"] = 1
    engine["cache"]["num_device_blocks"] = 512
    return engine


@pytest.fixture
def start_server(tiny_model_dir: pathlib.Path) -> Iterator[Callable[..., LocalServer]]:
    started: list[LocalServer] = []

    def start(grace_s: float, serial: bool = False) -> LocalServer:
        engine = tiny_engine(str(tiny_model_dir))
        if serial:
            engine = one_long_stream_at_a_time(engine)
        config = derived_config(engine=engine, limits=None, engine_deployment=None)
        server = LocalServer(config, grace_period_s=grace_s)
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.kill()


def test_sigterm_to_the_process_group_lets_streams_finish_then_exits_0_leaving_nothing(
    start_server: Callable[..., LocalServer],
) -> None:
    """What systemd, `timeout` and a container's init send: SIGTERM to every process of the
    server's group. Ray's processes must not take it (they would die under the drain): the
    server alone drains, stops them all and exits within the grace period."""
    grace_s = 20.0
    server = start_server(grace_s)
    assert server.process is not None
    started = psutil.Process(server.process.pid).children(recursive=True)
    assert any("raylet" in " ".join(p.cmdline()) for p in started)
    server.signal_group = True
    result = shutdown_under_load(server, signal.SIGTERM, streams=3, max_tokens=300, headers=None)
    assert result.exit_code == 0, result.output_tail
    assert result.completed == 3, result
    assert result.cut == 0 and result.error_without_done == 0
    assert result.refused_as_json_503 == 1, result.late_detail
    assert result.seconds_to_exit < grace_s, result.output_tail
    assert "SIGTERM received" not in result.output_tail  # Ray's native handler did not run
    assert "drained in" in result.output_tail
    for port in (server.http_port, server.grpc_port):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
    _, alive = psutil.wait_procs(started, timeout=1.0)
    assert not alive, [p.pid for p in alive]


def test_sigint_past_the_grace_period_ends_streams_with_an_error_event_then_exits_0(
    start_server: Callable[..., LocalServer],
) -> None:
    grace_s = 1.0
    server = start_server(grace_s, serial=True)
    result = shutdown_under_load(server, signal.SIGINT, streams=4, max_tokens=1000, headers=None)
    assert result.exit_code == 0, result.output_tail
    assert result.cut == 0 and result.error_without_done == 0, result
    assert result.error_events + result.completed + result.queued_503 == 4
    # 4 x 1000 tokens one at a time do not fit in the 2 s before the signal plus the 1 s grace:
    # the one running then ends with an error event, those still queued get a 503
    assert result.error_events == 1, result
    assert result.refused_as_json_503 == 1, result.late_detail
    assert result.seconds_to_exit < grace_s + EXIT_BOUND_S
    assert "the rest ended with an error" in result.output_tail
