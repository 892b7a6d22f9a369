"""LoRA adapters end to end on a real local Ray cluster: the tiny model with PEFT adapters built
by PEFT itself, over HTTP and gRPC.

Cache isolation and sharing (`usage.prompt_tokens_details.cached_tokens`): the same prompt under
adapter `a` twice hits a's blocks; under `b` it hits none of them; under a copy of a's files
loaded as another name it hits them all. Every bad input (unknown model, malformed adapter,
rank over `max_lora_rank`, wrong shapes, non-admin key, runtime updating off) is refused in
OpenAI's error body and leaves the served adapters' outputs unchanged. Loads and unloads race
streams: only requests naming the unloaded adapter after it is gone fail. An engine replica
killed after a runtime load is replaced by one that serves the runtime-loaded adapter too."""

from __future__ import annotations

import json
import pathlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest

from protos import generation_pb2 as pb
from protos import generation_pb2_grpc as pb_grpc
from tests.serving import two_replicas
from tests.serving.conftest import MODEL, Served, engine_section, quick_stop_options
from tests.serving.two_replicas import TwoReplicaApp

APP = "lora"
ROUTE = "/lora"
USER = {"Authorization": "Bearer lora-user"}
ADMIN = {"Authorization": "Bearer lora-admin"}
ROUTED_USER = {"Authorization": "Bearer key-alice"}
"""A key of the two-replica app (`tests/serving/conftest.py`'s API_KEYS)."""
PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun."
BLOCK_SIZE = 4


@dataclass(frozen=True)
class LoRAApp:
    base: str
    grpc_target: str
    adapters: dict[str, pathlib.Path]

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(
            f"{self.base}{path}",
            json=body,
            headers=USER if headers is None else headers,
            timeout=60,
        )

    def complete(self, model: str, prompt: str = PROMPT, **extra: Any) -> httpx.Response:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
        return self.post("/v1/completions", {"ignore_eos": True, **body})

    def load(
        self, name: str, path: pathlib.Path | str, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        body = {"lora_name": name, "lora_path": str(path)}
        return self.post("/v1/load_lora_adapter", body, ADMIN if headers is None else headers)

    def unload(self, name: str) -> httpx.Response:
        return self.post("/v1/unload_lora_adapter", {"lora_name": name}, ADMIN)

    def model_ids(self) -> list[str]:
        response = httpx.get(f"{self.base}/v1/models", headers=USER, timeout=30)
        return [card["id"] for card in response.json()["data"]]


@pytest.fixture(scope="module")
def lora_app(
    served: Served, tiny_model_dir: pathlib.Path, serving_adapters: dict[str, pathlib.Path]
) -> Iterator[LoRAApp]:
    from ray import serve

    from cluster.serving.serve_app import bind_app

    engine = engine_section(tiny_model_dir)
    engine["lora"] = {"max_lora_rank": 16, "max_loras": 2}
    args = {
        "served_model_name": MODEL,
        "engine": engine,
        "api_keys": {"lora-user": "alice", "lora-admin": {"tenant": "ops", "admin": True}},
        "lora_modules": {"a": str(serving_adapters["a"])},
        "allow_runtime_lora_updating": True,
    }
    app = bind_app(
        args,
        engine_options=quick_stop_options(max_ongoing_requests=64),
        ingress_options=quick_stop_options(),
    )
    serve.run(app, name=APP, route_prefix=ROUTE)
    yield LoRAApp(served.http_base + ROUTE, served.grpc_target, serving_adapters)
    serve.delete(APP)


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_blocks_are_shared_by_adapter_weights_never_across_adapters(lora_app: LoRAApp) -> None:
    assert lora_app.load("b", lora_app.adapters["b"]).status_code == 200
    assert lora_app.load("a2", lora_app.adapters["a_copy"]).status_code == 200
    first_a = lora_app.complete("a")
    again_a = lora_app.complete("a")
    num_prompt = first_a.json()["usage"]["prompt_tokens"]
    full_blocks = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert full_blocks >= 3 * BLOCK_SIZE
    assert (cached(first_a), cached(again_a)) == (0, full_blocks)
    under_b = lora_app.complete("b")
    assert cached(under_b) == 0  # a's blocks are never used for b
    assert cached(lora_app.complete("b")) == full_blocks  # b's own are
    under_copy = lora_app.complete("a2")
    assert cached(under_copy) == full_blocks  # same weights, another name and path
    base = lora_app.complete(MODEL)
    assert cached(base) == 0
    assert text(under_copy) == text(first_a) == text(again_a)
    assert len({text(first_a), text(under_b), text(base)}) == 3
    assert first_a.json()["model"] == "a"
    cards = httpx.get(f"{lora_app.base}/v1/models", headers=USER, timeout=30).json()["data"]
    by_id = {card["id"]: card for card in cards}
    assert set(by_id) == {MODEL, "a", "b", "a2"}
    assert by_id["b"]["parent"] == MODEL and by_id["b"]["root"] == str(lora_app.adapters["b"])


@pytest.mark.parametrize(
    ("adapter", "fragment"),
    [("malformed", "not valid JSON"), ("rank32", "rank 32"), ("wrong_shape", "shape")],
)
def test_a_bad_adapter_is_a_400_naming_it_and_nothing_else_changes(
    lora_app: LoRAApp, adapter: str, fragment: str
) -> None:
    before = text(lora_app.complete("a"))
    models = lora_app.model_ids()
    response = lora_app.load(f"bad-{adapter}", lora_app.adapters[adapter])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"]
    assert lora_app.model_ids() == models
    assert text(lora_app.complete("a")) == before
    assert lora_app.complete(f"bad-{adapter}").status_code == 404


def test_unknown_models_keys_and_names_get_openais_errors(lora_app: LoRAApp) -> None:
    unknown = lora_app.complete("gpt-4")
    assert unknown.status_code == 404
    assert {k: unknown.json()["error"][k] for k in ("type", "param", "code")} == {
        "type": "NotFoundError",
        "param": "model",
        "code": "model_not_found",
    }
    assert lora_app.load("c", lora_app.adapters["b"], USER).status_code == 403
    assert lora_app.load("c", lora_app.adapters["b"], {}).status_code == 401
    missing = lora_app.post("/v1/load_lora_adapter", {"lora_name": "c"}, ADMIN)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    other_path = lora_app.load("a", lora_app.adapters["b"])
    assert other_path.status_code == 400 and "already been loaded" in other_path.text
    assert lora_app.unload("never-loaded").status_code == 404
    assert "c" not in lora_app.model_ids()


def test_runtime_loading_is_absent_where_it_is_not_enabled(served: Served) -> None:
    response = httpx.post(
        f"{served.http_base}/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": "/nowhere"},
        headers={"Authorization": "Bearer key-alice"},
        timeout=30,
    )
    assert response.status_code == 404 and "error" in response.json()


def stream_text(
    lora_app: LoRAApp,
    model: str,
    results: dict[str, Any],
    key: str,
    first_token: threading.Event | None = None,
) -> None:
    """Streams a completion of `model` into `results[key]` (its text, an HTTP status or an error
    event); `first_token` is set once the first token arrived (or the stream ended)."""
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with httpx.stream(
            "POST", f"{lora_app.base}/v1/completions", json=body, headers=USER, timeout=120
        ) as response:
            if response.status_code != 200:
                results[key] = response.status_code
                return
            pieces = []
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        results[key] = event["error"]
                        return
                    pieces.append(event["choices"][0]["text"])
                    if first_token is not None:
                        first_token.set()
            results[key] = "".join(pieces)
    except Exception as error:  # reported to the test
        results[key] = repr(error)
    finally:
        if first_token is not None:
            first_token.set()


def test_loads_and_unloads_race_streams_and_only_the_unloaded_name_fails(
    lora_app: LoRAApp,
) -> None:
    alone: dict[str, Any] = {}
    for model in ("a", MODEL):
        stream_text(lora_app, model, alone, model)
    assert all(isinstance(v, str) and v for v in alone.values()), alone
    results: dict[str, Any] = {}
    threads = [
        threading.Thread(target=stream_text, args=(lora_app, m, results, f"{m}-{i}"))
        for i, m in enumerate(("a", MODEL, "a"))
    ]
    for thread in threads:
        thread.start()
    loaded = lora_app.load("racer", lora_app.adapters["b"])
    assert loaded.status_code == 200, loaded.text
    racer_decoding = threading.Event()
    racer = threading.Thread(
        target=stream_text, args=(lora_app, "racer", results, "racer", racer_decoding)
    )
    racer.start()
    assert racer_decoding.wait(60), "the racer's stream never produced a token"
    assert lora_app.unload("racer").status_code == 200  # while the racer decodes
    for thread in [*threads, racer]:
        thread.join(120)
    for key in ("a-0", "a-2"):
        assert results[key] == alone["a"], results
    assert results[f"{MODEL}-1"] == alone[MODEL], results
    after = lora_app.complete("racer")
    assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"
    # It was decoding when unloaded, so it finished: the text the same weights give alone.
    assert lora_app.load("racer-again", lora_app.adapters["b"]).status_code == 200
    stream_text(lora_app, "racer-again", alone, "racer-again")
    assert lora_app.unload("racer-again").status_code == 200
    assert isinstance(alone["racer-again"], str) and alone["racer-again"], alone
    assert results["racer"] == alone["racer-again"], results


INVALID = grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_selects_adapters_like_http(lora_app: LoRAApp) -> None:
    metadata = (("application", APP), ("authorization", "Bearer lora-user"))
    with grpc.insecure_channel(lora_app.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        sampling = pb.SamplingParameters(max_tokens=8, temperature=0, ignore_eos=True)
        request = pb.GenerateRequest(adapter="a", text=PROMPT, sampling=sampling)
        pieces = [c.text for r in stub.Generate(request, metadata=metadata) for c in r.choices]
        assert "".join(pieces) == text(lora_app.complete("a"))
        for bad, code in (
            (pb.GenerateRequest(adapter="nope", text="x"), grpc.StatusCode.NOT_FOUND),
            (pb.GenerateRequest(model="gpt-4", text="x"), grpc.StatusCode.NOT_FOUND),
            (
                pb.GenerateRequest(model="b", adapter="a", text="x"),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(bad, metadata=metadata))
            assert caught.value.code() == code


def test_adapter_metrics_are_on_metrics(lora_app: LoRAApp) -> None:
    lora_app.complete("a")
    body = httpx.get(f"{lora_app.base}/metrics", timeout=30).text
    assert 'pagedserve_adapter_requests_total{adapter="a"' in body
    assert 'pagedserve_adapter_generation_tokens_total{adapter="a"' in body
    assert "pagedserve_adapter_loads_total{" in body
    assert "pagedserve_adapter_evictions_total{" in body


def test_a_replacement_replica_serves_the_adapters_loaded_at_run_time(lora_app: LoRAApp) -> None:
    import ray

    from cluster.serving.serve_app import DEPLOYMENT_NAME

    assert lora_app.load("late", lora_app.adapters["b"]).status_code == 200
    expected = text(lora_app.complete("late"))
    victim = lora_app.complete("late").headers["x-pagedserve-replica"]
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#{DEPLOYMENT_NAME}#{victim}", namespace="serve")
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        response = lora_app.complete("late")
        if response.status_code == 200 and response.headers["x-pagedserve-replica"] != victim:
            assert text(response) == expected
            break
        time.sleep(0.2)
    else:
        pytest.fail("no replacement replica served the runtime-loaded adapter in 120 s")


def directory_entries() -> dict[str, int]:
    """Block hashes the two-replica app's KV directory indexes per engine replica (all tiers)."""
    import ray

    stats = ray.get(two_replicas.directory().report.remote()).stats
    return {replica: sum(tiers.values()) for replica, tiers in stats.entries_by_replica.items()}


def wait_for_entries(replica: str, at_least: int, timeout_s: float = 20.0) -> None:
    """Until the directory indexes `at_least` blocks of `replica` (its block events arrived)."""
    deadline = time.monotonic() + timeout_s
    while directory_entries().get(replica, 0) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)


def test_adapter_requests_go_to_the_replica_holding_their_prefix(
    two_replica_app: TwoReplicaApp,
) -> None:
    """The same adapter on the two engine replicas of the session's two-replica app, behind the
    prefix-aware router (which already indexes blocks of other tests: counted from here)."""
    tail = "the quick brown fox jumps over the lazy dog again and again"
    prompts = [f"{first} story: {tail}" for first in ("Alpine", "Coastal")]
    served_by: dict[str, set[str]] = {prompt: set() for prompt in prompts}
    indexed = directory_entries()  # replica -> blocks indexed, with this test's prompt blocks
    for round_ in range(3):
        for prompt in prompts:
            body = {"model": "a", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            response = httpx.post(
                f"{two_replica_app.base}/v1/completions",
                json=body,
                headers=ROUTED_USER,
                timeout=60,
            )
            replica = response.headers["x-pagedserve-replica"]
            served_by[prompt].add(replica)
            usage = response.json()["usage"]
            full_blocks = (usage["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
            expected = 0 if round_ == 0 else full_blocks
            assert usage["prompt_tokens_details"]["cached_tokens"] == expected, (round_, usage)
            if round_ == 0:
                indexed[replica] = indexed.get(replica, 0) + full_blocks // BLOCK_SIZE
            wait_for_entries(replica, indexed.get(replica, 0))
    assert all(len(replicas) == 1 for replicas in served_by.values()), served_by
