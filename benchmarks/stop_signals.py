"""How `pagedserve serve` stops: SIGINT or SIGTERM, sent to the server process alone or to its
whole process group (what systemd's `KillMode=control-group`, `timeout` and a container's init
send), idle or with streams in flight.

``python -m benchmarks.stop_signals --json`` starts one server per case (the shipped model, or
``--model DIR``), signals it and reports per case: the exit code (None: still running after
``--exit-timeout``, then killed), seconds from the signal to the exit, how the streams ended
(completed / error event then [DONE] / 503 while queued / cut), whether anything still
answered on the HTTP port once it exited, and how many of the processes it had started (Ray's
among them) were still alive a second later.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from benchmarks.reliability_probes import stream_outcome
from benchmarks.reliability_server import LocalServer, derived_config, tiny_engine

SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}
TARGETS = ("driver", "group")
LOADS = ("idle", "load")


@dataclass
class StopCase:
    """One stop: the signal, where it went, and whether streams were in flight."""

    signal: str
    target: str
    load: str

    @property
    def name(self) -> str:
        return f"{self.signal.lower()}-{self.target}-{self.load}"


@dataclass
class StopResult:
    exit_code: int | None
    seconds_to_exit: float
    streams: dict[str, int]
    port_answers_after_exit: bool
    processes_left: list[str]


def answers(port: int) -> bool:
    """Whether something accepts a TCP connection on 127.0.0.1:`port`."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def stop_once(server: LocalServer, case: StopCase, args: argparse.Namespace) -> StopResult:
    """Signals the running `server` as `case` says and watches it go."""
    assert server.process is not None
    outcomes: list[str] = []
    streams = args.streams if case.load == "load" else 0
    threads = [
        threading.Thread(
            target=lambda: outcomes.append(stream_outcome(server.base, args.max_tokens, None))
        )
        for _ in range(streams)
    ]
    for thread in threads:
        thread.start()
    if threads:
        time.sleep(2.0)
    started = psutil.Process(server.process.pid).children(recursive=True)
    server.signal_group = case.target == "group"
    signalled = time.monotonic()
    server.signal(SIGNALS[case.signal])
    try:
        code: int | None = server.wait(args.exit_timeout)
    except Exception:
        code = None
    seconds = time.monotonic() - signalled
    port_answers = code is not None and answers(server.http_port)
    if code is None:
        server.kill()
    time.sleep(1.0)
    left = []
    for process in started:
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(process.cmdline())[:80])
                process.kill()
    for thread in threads:
        thread.join(60)
    return StopResult(
        exit_code=code,
        seconds_to_exit=round(seconds, 1),
        streams={kind: outcomes.count(kind) for kind in sorted(set(outcomes))},
        port_answers_after_exit=port_answers,
        processes_left=left,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a model directory (default: shipped)")
    parser.add_argument("--grace-period", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--exit-timeout", type=float, default=90.0)
    parser.add_argument(
        "--cases",
        default=None,
        help="comma-separated case names, e.g. sigterm-group-load (default: all eight)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cases = [
        StopCase(sig, target, load)
        for sig, target, load in itertools.product(SIGNALS, TARGETS, LOADS)
    ]
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [case for case in cases if case.name in wanted]
    engine = tiny_engine(args.model) if args.model else None
    report: dict[str, Any] = {"grace_period_s": args.grace_period}
    for case in cases:
        config = derived_config(engine=engine, limits=None, engine_deployment=None)
        server = LocalServer(config, grace_period_s=args.grace_period)
        server.start()
        try:
            result = asdict(stop_once(server, case, args))
        finally:
            server.kill()
        report[case.name] = result
        print(f"{case.name}: {json.dumps(result)}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
