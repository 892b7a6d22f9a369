"""The serving edge under bad input, overload and shutdown, against one
`pagedserve serve --replicas 1` process with the shipped config and the tiny model, started on
localhost for this module (benchmarks/reliability_server.py). Every case sends a bounded number
of requests with a time limit; the last one stops the server with SIGTERM to its process group
(SIGINT past the grace period: tests/reliability/test_shutdown.py).
"""

from __future__ import annotations

import pathlib
import signal
import socket
import time
from collections.abc import Iterator

import grpc
import httpx
import psutil
import pytest

from benchmarks.idle_server_floor import ray_workers, server_processes
from benchmarks.reliability_probes import (
    burst,
    deep_nesting,
    fuzz_grpc,
    fuzz_http,
    huge_prompt_refusal,
    is_openai_error,
    shutdown_under_load,
)
from benchmarks.reliability_server import LocalServer, derived_config, tiny_engine

pytestmark = [pytest.mark.ray, pytest.mark.own_ray]

KEY = "key-reliability"
AUTH = {"authorization": f"Bearer {KEY}"}
METADATA = (("authorization", f"Bearer {KEY}"),)
MAX_BODY = 1024 * 1024
ONGOING, QUEUED, QUEUE_TIMEOUT_S = 2, 2, 8.0
GRACE_S = 20.0
"""Long enough for the streams in flight at the last test's SIGTERM to finish."""


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path) -> Iterator[LocalServer]:
    config = derived_config(
        engine=tiny_engine(str(tiny_model_dir)),
        limits={
            "max_body_bytes": MAX_BODY,
            "queue_timeout_s": QUEUE_TIMEOUT_S,
            "metrics": {"access": "api_key"},
        },
        engine_deployment={"max_ongoing_requests": ONGOING, "max_queued_requests": QUEUED},
        api_keys={KEY: "tenant"},
    )
    local = LocalServer(config, grace_period_s=GRACE_S)
    local.start()
    try:
        yield local
    finally:
        local.stop()
        local.kill()


def test_bad_http_bodies_fuzzed_over_the_schema_all_get_a_4xx_in_openais_shape(
    server: LocalServer,
) -> None:
    result = fuzz_http(server.base, examples=100, headers=AUTH)
    assert result.tried >= 100
    assert result.wrong == []
    assert server.kv_blocks_used(AUTH) == 0


def test_bad_grpc_requests_and_corrupt_bytes_are_all_invalid_argument(
    server: LocalServer,
) -> None:
    result = fuzz_grpc(server.grpc_target, examples=40, metadata=METADATA)
    assert result.tried >= 40
    assert result.wrong == []


def test_corrupt_protobuf_bytes_are_invalid_argument_not_unknown(server: LocalServer) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        generate = channel.unary_stream("/pagedserve.v1.Generation/Generate")
        with pytest.raises(grpc.RpcError) as caught:
            list(generate(b"\x0f\xff\xff", metadata=METADATA, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GenerateRequest" in caught.value.details()


def test_a_body_over_the_limit_is_413_before_parsing_and_health_stays_responsive(
    server: LocalServer,
) -> None:
    result = huge_prompt_refusal(server.base, 50 * 1024 * 1024, headers=AUTH)
    assert result.status == 413
    assert result.openai_shape
    assert result.refused_in_s < 5.0
    assert result.worst_health_s < 2.0  # loose: the machine is shared; figures in the benchmark


def test_a_chunked_body_over_the_limit_is_413_while_reading(server: LocalServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m", "prompt": "'
        for _ in range(2 * MAX_BODY // 65536):
            yield b"a" * 65536
        yield b'"}'

    response = httpx.post(
        f"{server.base}/v1/completions", content=chunks(), headers=AUTH, timeout=30
    )
    assert response.status_code == 413
    assert is_openai_error(response)


def test_json_nested_100000_levels_is_a_400_in_openais_shape(server: LocalServer) -> None:
    response = deep_nesting(server.base, 100_000, headers=AUTH)
    assert response.status_code == 400
    assert is_openai_error(response)


def test_a_10x_burst_is_shed_at_once_with_503_and_retry_after(server: LocalServer) -> None:
    result = burst(server.base, 10 * (ONGOING + QUEUED), max_tokens=48, headers=AUTH)
    assert result.connect_errors == 0
    assert result.other == []
    assert result.ok + result.shed == result.sent
    assert result.shed > 0
    assert result.shed_with_retry_after == result.shed
    assert result.worst_shed_s < QUEUE_TIMEOUT_S + 2
    assert server.kv_blocks_used(AUTH) == 0


def test_metrics_need_the_api_key_and_health_does_not(server: LocalServer) -> None:
    assert httpx.get(f"{server.base}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{server.base}/metrics", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200


def test_the_openapi_schema_is_published_with_the_request_models(server: LocalServer) -> None:
    schema = httpx.get(f"{server.base}/openapi.json", timeout=10).json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("CompletionRequest")
    assert {"CompletionRequest", "ChatCompletionRequest", "ChatMessage"} <= set(
        schema["components"]["schemas"]
    )


RAY_AGENTS = {"DashboardAgent", "RuntimeEnvAgent"}
"""Ray's own per-node agent processes (named like workers)."""


def test_no_ray_worker_runs_beside_serve_and_the_apps_own_actors(server: LocalServer) -> None:
    """Every Ray worker process wakes ~100 times a second on the engine's cores: the drain uses
    no actor of its own, and Ray keeps no idle worker (it kills one within about a second)."""
    assert server.process is not None
    deadline = time.monotonic() + 30
    while "IDLE" in (workers := ray_workers(server_processes(server.process.pid))):
        assert time.monotonic() < deadline, workers
        time.sleep(0.5)
    assert [name for name in workers if name not in RAY_AGENTS] == [
        "KVDirectory",
        "ProxyActor",
        "ServeController",
        "ServeReplica",
        "ServeReplica",
    ]


def test_sigterm_to_the_process_group_lets_streams_finish_then_exits_0_leaving_nothing(
    server: LocalServer,
) -> None:
    """Last: it stops the module's server. What systemd, `timeout` and a container's init send:
    SIGTERM to every process of the server's group. Ray's processes must not take it (they would
    die under the drain): the server alone drains, stops them all and exits within the grace
    period, with no native stack trace."""
    assert server.process is not None
    started = psutil.Process(server.process.pid).children(recursive=True)
    assert any("raylet" in " ".join(p.cmdline()) for p in started)
    server.signal_group = True
    result = shutdown_under_load(
        server, signal.SIGTERM, streams=ONGOING, max_tokens=300, headers=AUTH
    )
    assert result.exit_code == 0, result.output_tail
    assert result.completed == ONGOING, result
    assert result.cut == 0 and result.error_without_done == 0
    assert result.refused_as_json_503 == 1, result.late_detail
    assert result.seconds_to_exit < GRACE_S, result.output_tail
    assert "SIGTERM received" not in result.output_tail  # Ray's native handler did not run
    assert "drained in" in result.output_tail
    for port in (server.http_port, server.grpc_port):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
    _, alive = psutil.wait_procs(started, timeout=1.0)
    assert not alive, [p.pid for p in alive]
