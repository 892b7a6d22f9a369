"""An engine replica killed mid-load: a fault ends every affected request with an error the
client can read, and the rest keep going. On a real local Ray cluster, the two engine replicas
of the session's two-replica application (tests/serving/two_replicas.py): the replica serving a
stream is killed while the stream is open; the stream ends with an error event in OpenAI's
shape, a non-stream call on the same replica gets a JSON 503, and new requests are served by
the other replica at once."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from tests.serving.conftest import MODEL
from tests.serving.two_replicas import TwoReplicaApp, replica_actor_name

ALICE = {"Authorization": "Bearer key-alice"}


@pytest.fixture
def killed_base(two_replica_app: TwoReplicaApp) -> str:
    """The session's two-replica application: Serve replaces the killed replica, and the next
    test asking for the application waits for that (`two_replicas.wait_until_whole`)."""
    return two_replica_app.base


def kill_replica(replica_id: str) -> None:
    import ray

    ray.kill(ray.get_actor(replica_actor_name(replica_id), namespace="serve"), no_restart=True)


def requests_in_engines() -> int:
    """Requests the application's engine replicas run or queue now, as each reports its load."""
    import ray

    prefix = replica_actor_name("")
    names = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve" and actor["name"].startswith(prefix)
    ]
    stats = ray.get(
        [ray.get_actor(n, namespace="serve").record_routing_stats.remote() for n in names]
    )
    return sum(s["load"].num_running + s["load"].num_waiting for s in stats)


def wait_for_requests_in_engines(count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while requests_in_engines() < count and time.monotonic() < deadline:
        time.sleep(0.05)


def completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True, **extra}


@pytest.mark.kills_a_replica
def test_a_killed_replica_ends_its_requests_with_readable_errors(killed_base: str) -> None:
    url = f"{killed_base}/v1/completions"
    body = completion("Tell me a long story", max_tokens=400, stream=True)
    events: list[str] = []
    with httpx.stream("POST", url, json=body, headers=ALICE, timeout=60) as response:
        assert response.status_code == 200
        victim = response.headers["x-pagedserve-replica"]
        lines = response.iter_lines()
        while len(events) < 3:
            line = next(lines)
            if line.startswith("data: "):
                events.append(line)
        # A non-stream call with the same prompt: most likely routed to the same replica.
        outcome: dict[str, httpx.Response] = {}

        def unary() -> None:
            outcome["response"] = httpx.post(
                url,
                json=completion("Tell me a long story", max_tokens=300),
                headers=ALICE,
                timeout=60,
            )

        caller = threading.Thread(target=unary)
        caller.start()
        wait_for_requests_in_engines(2)  # the stream and the unary call
        kill_replica(victim)
        events.extend(line for line in lines if line.startswith("data: "))
        caller.join(timeout=60)
    assert events[-1] == "data: [DONE]", events[-3:]  # the stream ends as a client expects
    last = json.loads(events[-2].removeprefix("data: "))
    assert set(last) == {"error"}, events[-3:]
    assert {"message", "type", "code"} <= set(last["error"]) and last["error"]["message"]
    unary_response = outcome["response"]
    if unary_response.status_code != 200:  # it was on the killed replica: a JSON 503
        assert unary_response.status_code == 503, unary_response.text
        assert unary_response.json()["error"]["type"] == "server_error"
    # The other replica takes new requests with no gap.
    started = time.monotonic()
    after = httpx.post(url, json=completion("Hello", max_tokens=4), headers=ALICE, timeout=60)
    assert after.status_code == 200, after.text
    assert after.headers["x-pagedserve-replica"] != victim
    assert time.monotonic() - started < 10
