"""The session's one two-replica application (`two_replica_app` in tests/serving/conftest.py):
an ingress and two engine replicas behind `PrefixAwareRouter`, shared by the routing, peer
pull, KV directory fault, replica kill and routed LoRA tests, so the slow part (deploying two
engine replicas) happens once.

Its settings are the union of what those tests need: API keys, LoRA (adapter `a` served from
the start), peer pull whenever a peer holds more (no cost model), and a KV directory that drops
a silent replica within seconds. Tests that kill a replica or the directory leave the
application to Serve and Ray to repair: `wait_until_whole` (run before every test that asks for
the application) returns once two engine replicas run and the directory knows exactly those
two, so no test sees another's wreckage. Every test uses prompts of its own (its own seeded
random prefixes or texts), so a block another test cached never matches one of its prompts.
"""

from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass
from typing import Any

APP = "routed"
ROUTE = "/routed"
REPLICAS = 2
REPLICA_TIMEOUT_S = 4.0
"""The directory drops a replica silent this long: short, so a killed replica's entries go
soon; long enough that a replica on a busy 2-core machine is never dropped while alive."""
READY_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class TwoReplicaApp:
    """The application's HTTP base URL (handles reach it by name, `APP`) and the adapters the
    LoRA tests load (`a` is served from the start)."""

    base: str
    adapters: dict[str, pathlib.Path]


def app_args(
    model_name: str,
    engine: dict[str, Any],
    api_keys: dict[str, Any],
    adapter_a: pathlib.Path,
) -> dict[str, Any]:
    return {
        "served_model_name": model_name,
        "engine": {**engine, "lora": {"max_lora_rank": 16}},
        "api_keys": api_keys,
        "lora_modules": {"a": str(adapter_a)},
        "kv_transfer": {"use_cost_model": False, "timeout_s": 5.0},
        "directory": {"replica_timeout_s": REPLICA_TIMEOUT_S, "publish_period_s": 0.05},
    }


def replica_actor_name(replica_id: str) -> str:
    """The Ray actor of the application's engine replica `replica_id` (namespace "serve")."""
    from cluster.serving.serve_app import DEPLOYMENT_NAME

    return f"SERVE_REPLICA::{APP}#{DEPLOYMENT_NAME}#{replica_id}"


def directory() -> Any:
    """The application's KV directory actor."""
    import ray

    from cluster.serving.kv_directory import DIRECTORY_NAMESPACE, directory_name

    return ray.get_actor(directory_name(APP), namespace=DIRECTORY_NAMESPACE)


def _running_replicas() -> set[str]:
    from ray import serve

    from cluster.serving.serve_app import DEPLOYMENT_NAME

    status = serve.status().applications[APP].deployments[DEPLOYMENT_NAME]
    if status.status != "HEALTHY":
        return set()
    import ray

    prefix = replica_actor_name("")
    return {
        actor["name"].removeprefix(prefix)
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve" and actor["name"].startswith(prefix)
    }


def _indexed_replicas() -> set[str] | None:
    import ray

    try:
        return set(ray.get(directory().report.remote(), timeout=5).stats.entries_by_replica)
    except (ValueError, ray.exceptions.RayError):
        return None  # the directory is being restarted


def wait_until_whole(timeout_s: float = READY_TIMEOUT_S) -> None:
    """Returns once `REPLICAS` engine replicas run and the KV directory indexes exactly them
    (a killed replica replaced, its entries dropped, the new one heard from)."""
    deadline = time.monotonic() + timeout_s
    running: set[str] = set()
    indexed: set[str] | None = None
    while time.monotonic() < deadline:
        running = _running_replicas()
        indexed = _indexed_replicas()
        if len(running) == REPLICAS and indexed == running:
            return
        time.sleep(0.2)
    raise AssertionError(f"the two-replica app never recovered: running {running}, {indexed}")
