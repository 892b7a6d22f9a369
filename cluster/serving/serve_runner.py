"""Runs a Serve config in this process until SIGINT or SIGTERM, then shuts down cleanly: what
`pagedserve serve` does (`serve run` with a config file, plus a graceful, signal-safe exit).

On the first SIGINT or SIGTERM (what Ctrl-C and Kubernetes send), to this process alone or to
its whole process group (systemd's `KillMode=control-group`, `timeout`, a container's init) it
drains (cluster/serving/drain.py):
- the ingress replicas refuse new requests with a JSON 503 and Retry-After (gRPC
  RESOURCE_EXHAUSTED) and /health answers 503, while admitted requests run on;
- once none is in flight, or when only `STOP_RESERVE_S` of the grace period
  (`--shutdown-grace-s`, else the app's `shutdown.grace_s`) is left, the requests still running
  end with an error event in OpenAI's shape followed by `[DONE]` (gRPC UNAVAILABLE), and their
  engine calls are cancelled;
- only then is the cluster stopped (Serve's own shutdown stops the HTTP proxies first, which
  would cut open streams): a local cluster this process started is stopped whole, Ray's
  processes and every worker of theirs (cluster/serving/ray_processes.py; nothing answers on
  the ports afterwards); on a cluster it joined (RAY_ADDRESS) Serve is shut down;
- the process exits 0, within the grace period, with no native stack trace.
A signal to the process group reaches this process only: the local cluster's processes run in
sessions of their own (cluster/serving/ray_processes.py), so that they are stopped after the
drain, not killed under it. A second signal while draining ends the requests still running at
once; later ones are ignored.

Invariant: the only process-wide state is the signal handlers this runner installs while it
runs; they are restored before it returns.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import FrameType, MappingProxyType
from typing import Any, NoReturn

from cluster.serving.drain import POLL_PERIOD_S, SETTLE_S
from cluster.serving.drain_board import GcsKeyValue, RunnerBoard
from cluster.serving.ray_processes import own_session_for_ray_processes, reap_after

EXPIRE_WAIT_S = 5.0
"""How long the runner waits for expired requests to end before it stops Serve anyway."""

INGRESS_EXTRA_GRACE_S = 5.0
"""How much longer than the engines an ingress replica may drain: it must outlive them to turn
their end into error events."""

STOP_RESERVE_S = 6.0
"""Of the grace period, what ending the requests still running (an error event each), letting
the front ends write their last bytes and stopping Serve and Ray take after the drain."""

log = logging.getLogger("pagedserve.serve")


def drain_budget_s(grace_s: float) -> float:
    """How long in-flight requests may run after the signal: the grace period less what
    ending them and stopping Serve and Ray take (`STOP_RESERVE_S`), so that the process exits
    within the grace period."""
    return max(0.0, grace_s - STOP_RESERVE_S)


def apply_grace_period(
    config: dict[str, Any], grace_s: float, engine_names: Collection[str]
) -> None:
    """Sets `graceful_shutdown_timeout_s` on every deployment of `config`: `grace_s` on the
    engine deployments (named in `engine_names`), `grace_s + INGRESS_EXTRA_GRACE_S` on the
    others."""
    for app in config.get("applications", []):
        for deployment in app.get("deployments", []):
            extra = 0.0 if deployment.get("name") in engine_names else INGRESS_EXTRA_GRACE_S
            deployment["graceful_shutdown_timeout_s"] = grace_s + extra
            deployment.setdefault("graceful_shutdown_wait_loop_s", 0.5)


@dataclass(frozen=True)
class StopSignals:
    """`stop`: set by the first SIGINT or SIGTERM; `hurry`: by the second (end requests now)."""

    stop: threading.Event = field(default_factory=threading.Event)
    hurry: threading.Event = field(default_factory=threading.Event)


@contextmanager
def shutdown_requested() -> Iterator[StopSignals]:
    """The signals received while the block runs (see `StopSignals`)."""
    signals = StopSignals()

    def handle(signum: int, _: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signals.hurry.is_set():
            print(f"pagedserve serve: {name} again; already shutting down", flush=True)
        elif signals.stop.is_set():
            print(f"pagedserve serve: {name} again: ending in-flight requests now", flush=True)
            signals.hurry.set()
        else:
            print(
                f"pagedserve serve: {name}: draining in-flight requests, then exiting", flush=True
            )
            signals.stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield signals
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class DrainReport:
    """How a drain went: requests in flight when it began, whether the grace period (or a second
    signal) had to end some, and how long it took."""

    in_flight_at_start: int = 0
    expired: bool = False
    seconds: float = 0.0


def drain(board: RunnerBoard, grace_s: float, hurry: threading.Event) -> DrainReport:
    """Stops admission, waits until nothing is in flight or `grace_s` passed (or `hurry` is set),
    then ends what still runs and waits (bounded) until the ingresses report it gone."""
    started = time.monotonic()
    board.begin()
    hurry.wait(2 * POLL_PERIOD_S + 0.1)  # every gate has seen the phase and reported its count
    report = DrainReport(in_flight_at_start=board.in_flight()[0])
    deadline = started + grace_s
    while board.in_flight()[0] > 0:
        if hurry.is_set() or time.monotonic() >= deadline:
            report.expired = True
            board.expire()
            ended_by = time.monotonic() + EXPIRE_WAIT_S
            while board.in_flight()[0] > 0 and time.monotonic() < ended_by:
                time.sleep(POLL_PERIOD_S)
            break
        hurry.wait(POLL_PERIOD_S)
    time.sleep(SETTLE_S)  # the front ends write their last bytes
    report.seconds = time.monotonic() - started
    return report


LOCAL_CLUSTER_ENV: Mapping[str, str] = MappingProxyType(
    {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_num_workers_soft_limit": "0"}
)
"""Settings a new local cluster's processes get unless the environment sets them:
- Serve's controller runs its control loop every 0.5 s instead of 0.1 s (each pass fetches the
  cluster's node table from GCS, which at 0.1 s takes a noticeable share of a core beside engines
  whose threads fill the cores: 12-16 % of a core after a deploy);
- Ray keeps no idle worker process (it would keep the one that ran Serve's application build,
  as many as the node has CPUs): an idle Ray worker still wakes ~100 times a second, which on
  2 cores slows the served decode step by a few percent. A task then starts a worker (about a
  second); serving runs on actors only."""

NO_DASHBOARD_CLUSTER_ENV: Mapping[str, str] = MappingProxyType(
    {
        "RAY_enable_metrics_collection": "0",
        "RAY_task_events_report_interval_ms": "0",
        "RAY_event_stats": "0",
    }
)
"""...and, when that cluster has no dashboard to show them, no Ray metrics, no task events and no
event-loop statistics: every Ray process records and reports them on timers, about 0.01 cores of an
idle server's 0.146 and 2 % of a served burst's output rate on 2 cores. pagedserve's `/metrics` and
Serve's autoscaling do not read them."""


def cluster_options(address: str, ray_dashboard: bool) -> dict[str, Any]:
    """`ray.init` options beyond the address: a new local cluster (`address` "local") gets the
    dashboard only when asked; an existing cluster is joined as it is."""
    return {"include_dashboard": ray_dashboard} if address == "local" else {}


def local_cluster_env(
    address: str, environ: Mapping[str, str], ray_dashboard: bool
) -> dict[str, str]:
    """The variables to add to `environ` before `ray.init` starts a new local cluster (whose
    processes inherit the driver's environment): `LOCAL_CLUSTER_ENV`, with
    `NO_DASHBOARD_CLUSTER_ENV` unless `ray_dashboard`, less what `environ` already sets. Nothing
    for an existing cluster, which is joined as it is."""
    if address != "local":
        return {}
    wanted = {**LOCAL_CLUSTER_ENV, **({} if ray_dashboard else NO_DASHBOARD_CLUSTER_ENV)}
    return {name: value for name, value in wanted.items() if name not in environ}


def run_config(
    config: dict[str, Any],
    *,
    grace_s: float,
    ready_file: str | None = None,
    ray_dashboard: bool = False,
) -> int:
    """Deploys `config` (a validated Serve config) on a Ray cluster (RAY_ADDRESS, else a new
    local one), waits for a signal, drains for up to `grace_s`, shuts down and returns the exit
    status (0). A new local cluster starts without Ray's dashboard unless `ray_dashboard`: its
    dozen processes wake every few milliseconds, and each wake-up stalls a forward pass whose
    threads fill the cores (15-20 % slower decode steps on 2 cores)."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    address = os.environ.get("RAY_ADDRESS") or "local"
    started_ray = not ray.is_initialized()
    if started_ray:
        os.environ.update(local_cluster_env(address, os.environ, ray_dashboard))
        with own_session_for_ray_processes() if address == "local" else nullcontext():
            ray.init(
                address=address,
                namespace=SERVE_NAMESPACE,
                **cluster_options(address, ray_dashboard),
            )
    own_cluster = started_ray and address == "local"
    try:
        # After ray.init: Ray's core worker installs a native SIGTERM handler that prints a
        # stack trace and aborts; the Python handlers installed here replace it, and stay until
        # Ray is down (a signal while stopping changes nothing).
        with shutdown_requested() as signals:
            # Before the deploy, so every ingress replica finds the phase when it starts; its
            # keys are removed only after Serve has stopped, so no replica goes back to
            # admitting work.
            board = RunnerBoard(GcsKeyValue())
            board.open()
            try:
                serve_until_drained(
                    schema, board, signals, grace_s, ready_file, stop_serve=not own_cluster
                )
            finally:
                if own_cluster:
                    stop_local_cluster(ray)
                board.close(remove_keys=not own_cluster)
    finally:
        if started_ray:
            ray.shutdown()  # nothing left to do once `stop_local_cluster` ran
    sys.stdout.flush()
    return 0


def exit_at_once(code: int) -> NoReturn:
    """Ends the process with `code` once its output is flushed, without the interpreter's
    teardown: after the cluster has stopped, finalizing Ray's and torch's native objects took
    another 2-7 s on 2 shared cores, time the grace period does not have. Only for the
    command line, never for a caller that goes on."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_local_cluster(ray: Any) -> None:
    """Stops the local cluster this process started, all of it: Ray's processes, and any of
    their workers still alive `REAP_WAIT_S` later. Serve's own shutdown is skipped: the drain
    has ended every request, and stopping each deployment gracefully (seconds per replica)
    would only spend the grace period."""
    started = time.monotonic()
    with reap_after():
        ray.shutdown()
    print(f"pagedserve serve: Ray stopped in {time.monotonic() - started:.1f} s", flush=True)


def serve_until_drained(
    schema: Any,
    board: RunnerBoard,
    signals: StopSignals,
    grace_s: float,
    ready_file: str | None,
    stop_serve: bool = True,
) -> None:
    """Deploys `schema`, serves until the first signal, drains through `board` so that the
    process can stop within `grace_s` of the signal, then shuts Serve down if `stop_serve`
    (a cluster this process joined outlives it)."""
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.config import gRPCOptions

    client = serve_api.serve_start(
        http_options=schema.http_options.model_dump(),
        proxy_location=schema.proxy_location,
        grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
    )
    client.deploy_apps(schema, _blocking=False)
    print("pagedserve serve: deployed; Ctrl-C or SIGTERM stops it", flush=True)
    if ready_file is not None:
        wait_running(serve, [app.name for app in schema.applications], signals.stop)
        with open(ready_file, "w") as handle:
            handle.write("ready\n")
    while not signals.stop.wait(0.1):  # short: the grace period runs from the signal
        pass
    try:
        drained = drain(board, drain_budget_s(grace_s), signals.hurry)
    except Exception as error:  # e.g. the GCS is gone: stop Serve anyway, exit 0
        print(f"pagedserve serve: drain failed ({error!r}); stopping now", flush=True)
    else:
        print(
            f"pagedserve serve: drained in {drained.seconds:.1f} s "
            f"({drained.in_flight_at_start} in flight at the signal"
            + (", the rest ended with an error)" if drained.expired else ", all finished)"),
            flush=True,
        )
    if stop_serve:
        started = time.monotonic()
        serve.shutdown()
        print(
            f"pagedserve serve: Serve shut down in {time.monotonic() - started:.1f} s", flush=True
        )


def wait_running(serve: Any, names: list[str], stop: threading.Event) -> None:
    """Blocks until every application named is RUNNING (or a signal arrives)."""
    from ray.serve.schema import ApplicationStatus

    while not stop.is_set():
        statuses = serve.status().applications
        if all(
            name in statuses and statuses[name].status == ApplicationStatus.RUNNING
            for name in names
        ):
            return
        stop.wait(0.5)
