"""A tensor-parallel rank killed mid-load: `pagedserve serve` as a subprocess with the
tiny model split over two rank actors (backend ray), streams and a non-stream call in flight,
then SIGKILL to one rank's process.

The replica must notice within seconds (its step fails with the actor's death), end every
in-flight request with a readable error (an OpenAI error event and `[DONE]`, a JSON 503), report
itself unhealthy (/health 503) so Serve replaces it, and serve new requests again with no KV
block left in use. Bounded: one server start (about 30 s) and waits of at most 120 s.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from benchmarks.reliability_faults import kill_rank, kill_under_load
from benchmarks.reliability_server import LocalServer, derived_config, tiny_engine

pytestmark = [pytest.mark.ray, pytest.mark.own_ray]

RESUME_LIMIT_S = 90.0


@pytest.fixture
def tp2_server(tiny_model_dir: pathlib.Path) -> Iterator[LocalServer]:
    engine = tiny_engine(str(tiny_model_dir))
    engine["parallel"] = {"tensor_parallel_size": 2, "backend": "ray"}
    server = LocalServer(derived_config(engine=engine, limits=None, engine_deployment=None))
    server.start()
    try:
        yield server
    finally:
        server.stop()
        server.kill()


def test_a_killed_rank_fails_its_requests_cleanly_and_the_replica_is_replaced(
    tp2_server: LocalServer,
) -> None:
    result = kill_under_load(
        tp2_server, kill_rank, streams=3, unary=1, probe_for_s=0, resume_timeout_s=RESUME_LIMIT_S
    )
    assert "of 2" in result.killed
    assert result.cut == 0 and result.error_without_done == 0, result
    assert result.error_events >= 1, result  # 400 tokens each were still running
    assert result.error_events + result.refused_json_503 + result.completed == 3, result
    assert result.seconds_to_notice is not None and result.seconds_to_notice < 5.0
    assert result.unary_other == [], result
    assert result.unary_ok + result.unary_json_503 == 1
    assert result.health_after_kill.startswith("503"), result.health_after_kill
    assert "ActorDied" in result.health_after_kill or "died" in result.health_after_kill
    assert result.seconds_to_resume is not None and result.seconds_to_resume < RESUME_LIMIT_S
    assert tp2_server.kv_blocks_used() == 0
    assert len(tp2_server.processes("WorkerRank")) == 2  # the new replica's group
