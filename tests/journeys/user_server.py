"""One `pagedserve serve` process started the way `make serve` starts it, on ports of its own.

It is the venv's `pagedserve` script (the one `make serve` runs) with the shipped config, the
ports, a ready file, and what the LoRA journeys need: `--lora-modules` and
`--allow-runtime-lora-updating` (docs/lora.md's flags). It runs in its own process group, so a
stop is what an init system or a terminal sends: SIGTERM to the group.

Invariants: it only ever talks to the server it started; after `terminate` the group is gone
(killed if it outlived the wait), so no test leaves a server behind.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.ports import free_port


def pagedserve_script() -> str:
    """The `pagedserve` console script beside this interpreter (what `make serve` runs)."""
    return str(pathlib.Path(sys.executable).with_name("pagedserve"))


def answers(port: int) -> bool:
    """Whether anything accepts a TCP connection on localhost:`port`."""
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class UserServer:
    workdir: pathlib.Path
    extra_args: list[str] = field(default_factory=list)
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    start_timeout_s: float = 300.0
    deadline: float = 0.0
    stopped: bool = False
    """Set once a test stopped it: a later test asking for it fails rather than hangs."""

    @property
    def base_url(self) -> str:
        return f"http://localhost:{self.http_port}/v1"

    @property
    def grpc_target(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def log_path(self) -> pathlib.Path:
        return self.workdir / "serve.log"

    def launch(self) -> None:
        """Starts the process and returns at once (`wait_ready` waits for it to serve), so a
        test can use the start-up's minute for in-process work."""
        command = [
            pagedserve_script(),
            "serve",
            "--port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            "--ready-file",
            str(self.workdir / "ready"),
            *self.extra_args,
        ]
        env = {**os.environ, "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.deadline = time.monotonic() + self.start_timeout_s

    def wait_ready(self) -> None:
        """Returns once the ready file is written and /health answers 200."""
        assert self.process is not None
        while not ((self.workdir / "ready").exists() and self._healthy()):
            if self.process.poll() is not None or time.monotonic() > self.deadline:
                self.kill()
                raise RuntimeError(f"`pagedserve serve` did not come up; log:\n{self.log_tail()}")
            time.sleep(0.1)  # a file test and a local GET: cheap

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"http://localhost:{self.http_port}/health", timeout=5).is_success
        except httpx.HTTPError:
            return False

    def terminate(self, timeout_s: float) -> tuple[int | None, float]:
        """SIGTERM to the process group; the exit status (None: it outlived `timeout_s` and
        the group was killed) and the seconds it took."""
        assert self.process is not None
        self.stopped = True
        began = time.monotonic()
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            status: int | None = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            status = None
        took = time.monotonic() - began
        self.kill()
        return status, took

    def kill(self) -> None:
        """SIGKILL whatever is left of the process group."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(30)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
