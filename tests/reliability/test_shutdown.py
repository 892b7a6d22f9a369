"""Shutdown under load: `pagedserve serve` started as a subprocess with the
tiny model, streams in flight, then SIGINT (Ctrl-C) to the server alone, past a grace period
too short for them.

The signal must stop new work at once (a JSON 503 with Retry-After), end each stream still
running with an OpenAI error event and `[DONE]` (never cut), shut Ray down and exit 0. SIGTERM
to the whole process group, streams finishing within the grace period and nothing left behind
are the last test of tests/reliability/test_edge_reliability.py, on that module's server. The
test starts its own server (about 30 s) and bounds every wait.
"""

from __future__ import annotations

import pathlib
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.reliability_probes import shutdown_under_load
from benchmarks.reliability_server import LocalServer, derived_config, tiny_engine

pytestmark = [pytest.mark.ray, pytest.mark.own_ray]

GRACE_S = 1.0
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
def serial_server(tiny_model_dir: pathlib.Path) -> Iterator[LocalServer]:
    """The tiny engine one stream at a time, with a grace period of `GRACE_S`."""
    engine = one_long_stream_at_a_time(tiny_engine(str(tiny_model_dir)))
    config = derived_config(engine=engine, limits=None, engine_deployment=None)
    server = LocalServer(config, grace_period_s=GRACE_S)
    try:
        server.start()
        yield server
    finally:
        server.kill()


def test_sigint_past_the_grace_period_ends_streams_with_an_error_event_then_exits_0(
    serial_server: LocalServer,
) -> None:
    result = shutdown_under_load(
        serial_server, signal.SIGINT, streams=4, max_tokens=1000, headers=None
    )
    assert result.exit_code == 0, result.output_tail
    assert result.cut == 0 and result.error_without_done == 0, result
    assert result.error_events + result.completed + result.queued_503 == 4
    # 4 x 1000 tokens one at a time do not fit in the 2 s before the signal plus the 1 s grace:
    # the one running then ends with an error event, those still queued get a 503
    assert result.error_events == 1, result
    assert result.refused_as_json_503 == 1, result.late_detail
    assert result.seconds_to_exit < GRACE_S + EXIT_BOUND_S
    assert "the rest ended with an error" in result.output_tail
