"""Runs a Serve config in this process until SIGINT or SIGTERM, then shuts down cleanly: what
`pagedserve serve` does (`serve run` with a config file, plus a graceful, signal-safe exit).

On the first SIGINT or SIGTERM (what Ctrl-C and Kubernetes send):
- Serve stops routing new requests to the application's replicas (they are being deleted);
- every replica waits up to its `graceful_shutdown_timeout_s` for its in-flight requests: the
  engines for `grace_s` (`--grace-period`), the ingress a little longer, so that a stream still
  running when its engine replica is stopped ends with an error event in OpenAI's shape (the
  ingress maps the lost replica to one) rather than being cut;
- Ray is shut down and the process exits 0, with no native stack trace.
A second signal while shutting down is ignored (logged): the grace period bounds the wait.

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
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

INGRESS_EXTRA_GRACE_S = 5.0
"""How much longer than the engines an ingress replica may drain: it must outlive them to turn
their end into error events."""

log = logging.getLogger("pagedserve.serve")


def apply_grace_period(config: dict[str, Any], grace_s: float, engine_name: str) -> None:
    """Sets `graceful_shutdown_timeout_s` on every deployment of `config`: `grace_s` on the
    engine deployment (`engine_name`), `grace_s + INGRESS_EXTRA_GRACE_S` on the others."""
    for app in config.get("applications", []):
        for deployment in app.get("deployments", []):
            extra = 0.0 if deployment.get("name") == engine_name else INGRESS_EXTRA_GRACE_S
            deployment["graceful_shutdown_timeout_s"] = grace_s + extra
            deployment.setdefault("graceful_shutdown_wait_loop_s", 0.5)


@contextmanager
def shutdown_requested() -> Iterator[threading.Event]:
    """An event set by the first SIGINT or SIGTERM while the block runs."""
    event = threading.Event()

    def handle(signum: int, _: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if event.is_set():
            print(f"pagedserve serve: {name} again; already shutting down", flush=True)
            return
        print(f"pagedserve serve: {name}: draining in-flight requests, then exiting", flush=True)
        event.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield event
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_config(config: dict[str, Any], *, ready_file: str | None = None) -> int:
    """Deploys `config` (a validated Serve config) on a Ray cluster (RAY_ADDRESS, else a new
    local one), waits for a signal, shuts down gracefully and returns the exit status (0)."""
    import ray
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    address = os.environ.get("RAY_ADDRESS") or "local"
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=address, namespace=SERVE_NAMESPACE)
    try:
        # After ray.init: Ray's core worker installs a native SIGTERM handler that prints a
        # stack trace and aborts; the Python handlers installed here replace it.
        with shutdown_requested() as stop:
            client = serve_api.serve_start(
                http_options=schema.http_options.model_dump(),
                proxy_location=schema.proxy_location,
                grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
            )
            client.deploy_apps(schema, _blocking=False)
            print("pagedserve serve: deployed; Ctrl-C or SIGTERM stops it", flush=True)
            if ready_file is not None:
                wait_running(serve, [app.name for app in schema.applications], stop)
                with open(ready_file, "w") as handle:
                    handle.write("ready\n")
            while not stop.wait(0.5):
                pass
            started = time.monotonic()
            serve.shutdown()
            print(
                f"pagedserve serve: Serve shut down in {time.monotonic() - started:.1f} s",
                flush=True,
            )
    finally:
        if started_ray:
            ray.shutdown()
    sys.stdout.flush()
    return 0


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
