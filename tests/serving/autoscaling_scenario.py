"""The autoscaling scenario, run in its own process (it needs its own Ray cluster):
`python -m tests.serving.autoscaling_scenario MODEL_DIR` prints one JSON object.

A simulated three-node Ray cluster (`ray.cluster_utils.Cluster`) where each node offers one
`replica_slot`, so each replica must land on a node of its own. The deployment autoscales between
1 and 3 replicas with the KV-pressure policy; concurrent load drives it up, then a trickle of
single requests (which must keep succeeding) lets it shrink back.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.engine.sampling_params import SamplingParams
from cluster.serving.autoscaling import POLICY_PATH
from tests.serving.conftest import MODEL, engine_section

SLOT = "replica_slot"
NODES = 3
LOAD_CONCURRENCY = 8
MAX_ONGOING = 4
UP_TIMEOUT_S = 90.0
DOWN_TIMEOUT_S = 30.0
SERVE_TIMEOUT_S = 10.0
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": NODES,
    "target_ongoing_requests": 1,
    "metrics_interval_s": 0.2,
    "look_back_period_s": 1.0,
    "upscale_delay_s": 0.5,
    "downscale_delay_s": 2.0,
    "policy": {"policy_function": POLICY_PATH, "policy_kwargs": {"target_kv_utilization": 0.8}},
}


@dataclass
class Outcome:
    replica_counts: list[int] = field(default_factory=list)
    peak_replicas: int = 0
    slots_free_at_peak: float = -1.0
    final_replicas: int = 0
    succeeded: int = 0
    failed: list[str] = field(default_factory=list)
    replicas_that_served: int = 0


def running_replicas(app: str) -> int:
    from ray import serve

    status = serve.status().applications[app].deployments["GenerationServer"]
    return int(status.replica_states.get("RUNNING", 0))


async def one_request(client: Any, outcome: Outcome, served_by: set[str]) -> None:
    try:
        last = await client.generate("Hello", PARAMS)
        assert last.output.finished
        assert len(last.output.outputs[0].token_ids) == PARAMS.max_tokens
        served_by.add(last.replica_id)
        outcome.succeeded += 1
    except Exception as error:  # every failure is reported, none is expected
        outcome.failed.append(repr(error)[:300])


async def drive(app: str) -> Outcome:
    import ray

    from tests.serving.routed_calls import RoutedClient

    handle = await RoutedClient.connect(app)

    outcome, served_by = Outcome(), set[str]()
    stop = asyncio.Event()

    async def worker() -> None:
        while not stop.is_set():
            await one_request(handle, outcome, served_by)

    def observe() -> int:
        count = running_replicas(app)
        outcome.replica_counts.append(count)
        if count > outcome.peak_replicas:
            outcome.peak_replicas = count
            outcome.slots_free_at_peak = ray.available_resources().get(SLOT, 0.0)
        return count

    workers = [asyncio.create_task(worker()) for _ in range(LOAD_CONCURRENCY)]
    deadline = time.monotonic() + UP_TIMEOUT_S
    while observe() < NODES and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while len(served_by) < outcome.peak_replicas and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # until the new replicas have served requests too
    stop.set()
    await asyncio.gather(*workers)
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while observe() > 1 and time.monotonic() < deadline:
        await one_request(handle, outcome, served_by)  # a trickle, one at a time
        await asyncio.sleep(0.2)
    outcome.final_replicas = observe()
    outcome.replicas_that_served = len(served_by)
    return outcome


def main(model_dir: str) -> None:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from cluster.serving.serve_app import bind_app

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {SLOT: 1}, "include_dashboard": False},
    )
    for _ in range(NODES - 1):
        cluster.add_node(num_cpus=0, resources={SLOT: 1})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        engine = engine_section(pathlib.Path(model_dir))
        # Serve admits at most max_ongoing_requests per replica; the engine must queue them all
        # (several arrive between two steps), or it refuses them as overloaded.
        engine["scheduler"]["max_waiting_requests"] = MAX_ONGOING
        args = {"served_model_name": MODEL, "engine": engine}
        engine_options = {
            "autoscaling_config": AUTOSCALING,
            "max_ongoing_requests": MAX_ONGOING,
            "ray_actor_options": {"num_cpus": 0, "resources": {SLOT: 1}},
            "graceful_shutdown_wait_loop_s": 0.2,
            "graceful_shutdown_timeout_s": 5,
        }
        ingress_options = {"ray_actor_options": {"num_cpus": 0}}
        app = bind_app(args, engine_options=engine_options, ingress_options=ingress_options)
        serve.run(app, name="autoscaled", route_prefix=None)
        outcome = asyncio.run(drive("autoscaled"))
        print("AUTOSCALING_OUTCOME " + json.dumps(asdict(outcome)), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
