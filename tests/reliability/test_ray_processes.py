"""The local cluster's processes as `pagedserve serve` owns them (cluster/serving/ray_processes.py),
without starting Ray: what Ray's launcher starts inside `own_session_for_ray_processes` leads a
session of its own (a signal to the server's process group misses it) and still dies with its
parent; `reap` kills what outlives the wait; the drain leaves the stop its reserve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from ray._private import services

from cluster.serving.ray_processes import own_session_for_ray_processes, reap
from cluster.serving.serve_runner import STOP_RESERVE_S, drain_budget_s

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_ray_launches_into_a_session_of_its_own_only_inside_the_block() -> None:
    launcher = services.ConsolePopen
    with own_session_for_ray_processes():
        inside = services.start_ray_process(SLEEPER, "test_sleeper", fate_share=True).process
    assert services.ConsolePopen is launcher
    outside = services.start_ray_process(SLEEPER, "test_sleeper", fate_share=True).process
    try:
        assert os.getsid(inside.pid) == inside.pid != os.getsid(0)
        assert os.getpgid(inside.pid) != os.getpgrp()
        assert os.getpgid(outside.pid) == os.getpgrp()  # as Ray starts it
        os.killpg(os.getpgid(inside.pid), 0)  # it leads a group of its own
    finally:
        for process in (inside, outside):
            process.kill()
            process.wait(10)


def test_a_process_in_its_own_session_still_dies_with_its_parent() -> None:
    """Ray's fate-sharing (PR_SET_PDEATHSIG) survives the new session: a parent killed with
    SIGKILL takes the process with it."""
    parent_code = (
        "import sys, time\n"
        "from ray._private import services\n"
        "from cluster.serving.ray_processes import own_session_for_ray_processes\n"
        "with own_session_for_ray_processes():\n"
        f"    child = services.start_ray_process({SLEEPER!r}, 't', fate_share=True).process\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert os.getsid(child.pid) == child.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        child.wait(10)  # raises TimeoutExpired if it outlived its parent
    finally:
        if parent.poll() is None:
            parent.kill()


def test_reap_kills_what_outlives_the_wait_and_counts_it() -> None:
    running = subprocess.Popen(SLEEPER)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = psutil.Process(done.pid)
    done.wait(30)
    started = time.monotonic()
    assert reap([psutil.Process(running.pid), gone], wait_s=0.5) == 1
    assert time.monotonic() - started < 5
    assert not psutil.pid_exists(running.pid)  # killed, and reaped by `reap`'s wait


def test_the_drain_leaves_the_stop_its_reserve_of_the_grace_period() -> None:
    assert drain_budget_s(25.0) == 25.0 - STOP_RESERVE_S
    assert drain_budget_s(1.0) == 0.0  # too short to wait: running requests end at once
