"""The disaggregated Serve application on a real local Ray cluster (tiny Llama, float32): one
`Prefill` and one `Decode` replica behind the ingress. Over HTTP the answer is the oracle's
greedy text with the right usage, the decode replica pulled the prompt's blocks from the prefill
replica, structured outputs hold across the hand-off, and killing the decode replica mid-stream
ends the stream with an error event while the prefill replica holds no block."""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving.conftest import MODEL, GreedyOracle, Served, engine_section, quick_stop_options

APP = "pd"
ROUTE = "/pd"
PROMPT = "Paged attention keeps the KV cache in fixed-size blocks, so a server can " * 3


@pytest.fixture(scope="module")
def pd_base(served: Served, tiny_model_dir: pathlib.Path) -> Iterator[str]:
    from ray import serve

    from cluster.serving.pd_app import build_pd_app

    side = {"deployment": quick_stop_options(num_replicas=1)}
    args = {
        "served_model_name": MODEL,
        "engine": engine_section(tiny_model_dir),
        "stream_interval": 1,
        "prefill": side,
        "decode": side,
    }
    serve.run(build_pd_app(args), name=APP, route_prefix=ROUTE)
    yield served.http_base + ROUTE
    serve.delete(APP)


def engine_metrics(deployment: str) -> Any:
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=APP)
    return handle.metrics.remote().result()[1]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True, **fields}


def stream_events(url: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        return [line for line in response.iter_lines() if line.startswith("data: ")]


def test_pd_answers_as_the_oracle_and_pulls_the_prompt(pd_base: str, oracle: GreedyOracle) -> None:
    url = f"{pd_base}/v1/completions"
    prompt_ids = oracle.prompt_ids(PROMPT)
    expected, _ = oracle.generate(prompt_ids, 8)
    unary = httpx.post(url, json=completion(max_tokens=8), timeout=60)
    assert unary.status_code == 200, unary.text
    body = unary.json()
    assert body["choices"][0]["text"] == oracle.text(expected)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == 8
    pulled = engine_metrics("Decode").kv_transfer.pulled_blocks
    assert pulled >= (len(prompt_ids) - 1) // 4 - 1  # the prompt's full blocks, pulled
    # /metrics shows both sides: one prefill and one decode replica, the decode one's pulls
    text = httpx.get(f"{pd_base}/metrics", timeout=10).text
    replicas, pulls = set(), {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == "pagedserve_kv_cache_blocks":
                replicas.add(sample.labels["replica"])
            if sample.name.startswith("pagedserve_kv_transfer_blocks"):
                key = (sample.labels["replica"], sample.labels.get("direction"))
                pulls[key] = sample.value
    assert len(replicas) == 2
    assert sum(v for (_, direction), v in pulls.items() if direction == "in") == pulled

    events = stream_events(url, completion(max_tokens=8, stream=True))
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == oracle.text(expected)
    reasons = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]]
    assert [r for r in reasons if r is not None] == ["length"]  # once, at the end

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"],
    }
    structured = completion(
        max_tokens=40,
        temperature=1.0,
        seed=11,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    structured.pop("ignore_eos")
    answer = httpx.post(url, json=structured, timeout=60)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["text"]), schema)


def decode_replica_actor() -> Any:
    import ray

    prefix = f"SERVE_REPLICA::{APP}#Decode#"
    (name,) = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve" and actor["name"].startswith(prefix)
    ]
    return ray.get_actor(name, namespace="serve")


def test_a_killed_decode_replica_ends_the_stream_and_leaks_nothing(pd_base: str) -> None:
    import ray

    url = f"{pd_base}/v1/completions"
    events: list[str] = []
    with httpx.stream(
        "POST", url, json=completion(max_tokens=400, stream=True), timeout=60
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while len(events) < 4:  # the first token (prefill) and some of the decode side's
            line = next(lines)
            if line.startswith("data: "):
                events.append(line)
        ray.kill(decode_replica_actor(), no_restart=True)
        events.extend(line for line in lines if line.startswith("data: "))
    assert events[-1] == "data: [DONE]", events[-3:]
    last = json.loads(events[-2].removeprefix("data: "))
    assert set(last) == {"error"} and last["error"]["message"], events[-3:]
    deadline = time.monotonic() + 10
    while engine_metrics("Prefill").pressure.device.used and time.monotonic() < deadline:
        time.sleep(0.05)
    prefill = engine_metrics("Prefill")
    assert prefill.pressure.device.used == 0 and prefill.num_running == 0
