"""Shutdown under load: `pagedserve serve` started as a subprocess with the
tiny model, streams in flight, then SIGTERM (what Kubernetes sends) or SIGINT (Ctrl-C).

Either signal must stop new work at once (a JSON 503 with Retry-After), let the streams in
flight finish within the grace period or else end each with an OpenAI error event and `[DONE]`
(never cut), shut Ray down and exit 0 within the grace period plus a bound, with no native
stack trace. Each test starts its own server (about 20 s) and bounds every wait.
"""

from __future__ import annotations

import pathlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

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


def test_sigterm_lets_streams_that_fit_the_grace_period_finish_then_exits_0(
    start_server: Callable[..., LocalServer],
) -> None:
    grace_s = 20.0
    server = start_server(grace_s)
    result = shutdown_under_load(server, signal.SIGTERM, streams=3, max_tokens=300, headers=None)
    assert result.exit_code == 0, result.output_tail
    assert result.completed == 3, result
    assert result.cut == 0 and result.error_without_done == 0
    assert result.refused_as_json_503 == 1, result.late_detail
    assert result.seconds_to_exit < grace_s + EXIT_BOUND_S
    assert "SIGTERM received" not in result.output_tail  # Ray's native handler did not run
    assert "drained in" in result.output_tail


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
