"""`pagedserve serve MODEL` with engine flags, as a user runs it: the shipped Serve config, the
tiny model as the positional argument, two tensor-parallel ranks asked for by flag (so two rank
actors: backend ray). What it serves is checked from outside: the model cards, gRPC's model info
and HF's greedy tokens.

The module's last test kills one of those ranks mid-load (SIGKILL to its process): the replica
must notice within seconds (its step fails with the actor's death), end every in-flight request
with a readable error (an OpenAI error event and `[DONE]`, a JSON 503), report itself unhealthy
(/health 503) so Serve replaces it, and serve new requests again with no KV block left in use.
It shares the module's one server start (about 30 s) and waits at most `RESUME_LIMIT_S`.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import grpc
import httpx
import pytest
import yaml

from benchmarks.reliability_faults import kill_rank, kill_under_load
from benchmarks.reliability_server import LocalServer
from cluster.serving.cli_serve import shipped_serve_config
from protos import generation_pb2 as pb
from protos import generation_pb2_grpc as pb_grpc
from tests.serving.conftest import GreedyOracle

pytestmark = [pytest.mark.ray, pytest.mark.own_ray]

ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--tensor-parallel-size",
    "2",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "64",
    "--block-size",
    "4",
]
RESUME_LIMIT_S = 90.0


@pytest.fixture(scope="module")
def server(tiny_model_dir: pathlib.Path) -> Iterator[LocalServer]:
    shipped = yaml.safe_load(shipped_serve_config().read_text())
    local = LocalServer(shipped, extra_args=[str(tiny_model_dir), *ENGINE_FLAGS])
    local.start()
    try:
        yield local
    finally:
        local.stop()
        local.kill()


def test_the_positional_model_is_served_under_its_path_with_its_own_context(
    server: LocalServer, tiny_model_dir: pathlib.Path
) -> None:
    (card,) = httpx.get(f"{server.base}/v1/models", timeout=30).json()["data"]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert card["id"] == card["root"] == str(tiny_model_dir)  # vLLM's default served name
    # the shipped config's 2048 was SmolLM2's: the tiny model runs with its own context
    assert card["max_model_len"] == config["max_position_embeddings"]
    assert card["architecture"] == config["model_type"]
    with grpc.insecure_channel(server.grpc_target) as channel:
        info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert (info.tensor_parallel_size, info.block_size, info.dtype) == (2, 4, "float32")
    assert info.architecture == config["model_type"]


def test_two_ranks_give_hf_greedy_tokens(
    server: LocalServer, tiny_model_dir: pathlib.Path, oracle: GreedyOracle
) -> None:
    prompt = "The capital of France is"
    expected, _ = oracle.generate(oracle.prompt_ids(prompt), 8)
    body = {
        "model": str(tiny_model_dir),
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{server.base}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == oracle.text(expected)


def test_a_killed_rank_fails_its_requests_cleanly_and_the_replica_is_replaced(
    server: LocalServer, tiny_model_dir: pathlib.Path
) -> None:
    """Last: it kills a rank, and the module's server serves again only once Serve replaced the
    replica."""
    result = kill_under_load(
        server,
        kill_rank,
        streams=3,
        unary=1,
        probe_for_s=0,
        resume_timeout_s=RESUME_LIMIT_S,
        model=str(tiny_model_dir),
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
    assert server.kv_blocks_used() == 0
    assert len(server.processes("WorkerRank")) == 2  # the new replica's group
