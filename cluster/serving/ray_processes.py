"""The local Ray cluster's processes as `pagedserve serve` owns them: out of reach of a signal
sent to the server's process group, and all gone when it exits.

A service manager stops a server by signalling its whole process group (systemd's
`KillMode=control-group`, `timeout`, a shell or a container's init). Ray starts its GCS and
raylet in the driver's group, and raylet its workers (Serve's controller, proxy and replicas),
so SIGTERM to the group killed raylet at once and left the driver draining through a dead
cluster, and the workers serving on, until SIGKILL. `own_session_for_ray_processes` starts
each of those processes in a session of its own instead: the driver alone receives the
signal, drains, then stops Serve and Ray itself. Ray keeps its own fate-sharing (each process
it starts dies with the driver: PR_SET_PDEATHSIG), so a SIGKILL to the driver still takes the
cluster down.

`reap_after` then makes sure nothing of ours outlives the driver: whatever it had started
and is still alive once `ray.shutdown` returned (a worker slow to notice its raylet is gone
would still answer on the HTTP port) is killed.

Invariant: the process-wide patch of Ray's process launcher lasts only while the block runs
(`ray.init`), and only where Ray fate-shares through the kernel (Linux); elsewhere Ray's
reaper relies on the process group, which is left as it is.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import psutil

REAP_WAIT_S = 2.0
"""How long processes that Ray's shutdown stopped may take to exit before they are killed."""


@contextlib.contextmanager
def own_session_for_ray_processes() -> Iterator[None]:
    """While the block runs, every process Ray starts from this one begins its own session
    (see the module doc)."""
    from ray._private import services
    from ray._private.utils import detect_fate_sharing_support

    if not sys.platform.startswith("linux") or not detect_fate_sharing_support():
        yield
        return
    launcher = services.ConsolePopen

    class OwnSessionPopen(launcher):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSessionPopen
    try:
        yield
    finally:
        services.ConsolePopen = launcher


def descendants() -> list[psutil.Process]:
    """Every process this one started, directly or not (Ray's, and through raylet its
    workers), alive now."""
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def reap(processes: list[psutil.Process], wait_s: float = REAP_WAIT_S) -> int:
    """Waits up to `wait_s` for `processes` to exit, then kills those still alive; returns
    how many it killed."""
    _, alive = psutil.wait_procs(processes, timeout=wait_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=wait_s)
    return len(alive)


@contextlib.contextmanager
def reap_after() -> Iterator[None]:
    """Once the block is over, kills whatever this process had started when it began and
    has not exited `REAP_WAIT_S` later (see the module doc)."""
    started = descendants()
    try:
        yield
    finally:
        killed = reap(started)
        if killed:
            print(f"pagedserve serve: killed {killed} Ray process(es) left running", flush=True)
