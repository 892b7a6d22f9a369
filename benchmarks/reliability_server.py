"""A `pagedserve serve` process on localhost for the reliability suite and benchmark.

`LocalServer` writes a Serve config derived from the shipped one (a model, small overrides),
starts `pagedserve serve --replicas N` (1 unless told) on free ports in its own process group,
waits for its ready file, and stops it with a signal. It also reads the figures every scenario
ends with: KV blocks in use (from /metrics) and the RSS of the server's own Ray processes.

Invariants: it only ever talks to the server it started (localhost, its own ports), and `stop`
never leaves that process group running.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from benchmarks.ports import free_port
from cluster.serving.cli_serve import shipped_serve_config

ENGINE = "GenerationServer"
INGRESS = "OpenAIIngress"
READY_POLL_S = 0.1
"""How often `start` looks for the ready file and /health: a file test and a local GET, cheap
beside a start-up of many seconds, which a coarser poll would only lengthen."""


def tiny_engine(model_dir: str) -> dict[str, Any]:
    """The engine section for the suite's tiny model: small on purpose, overload is easy."""
    return {
        "model": {"model": model_dir, "max_model_len": 512, "dtype": "float32"},
        "parallel": {"tensor_parallel_size": 1, "backend": "local"},
        "cache": {"block_size": 4, "num_device_blocks": 256, "num_cpu_blocks": 16},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64},
    }


def derived_config(
    *,
    engine: dict[str, Any] | None,
    limits: dict[str, Any] | None,
    engine_deployment: dict[str, Any] | None,
    api_keys: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The shipped Serve config with the given sections replaced (None: as shipped)."""
    config = yaml.safe_load(shipped_serve_config().read_text())
    (app,) = config["applications"]
    args = app["args"]
    if engine is not None:
        args["engine"] = copy.deepcopy(engine)
    if limits is not None:
        args["limits"] = {**args.get("limits", {}), **limits}
    if api_keys is not None:
        args["api_keys"] = dict(api_keys)
    for deployment in app["deployments"]:
        deployment.setdefault("ray_actor_options", {})["num_cpus"] = 0
        if deployment["name"] == ENGINE and engine_deployment is not None:
            deployment.update(engine_deployment)
    return config


@dataclass
class LocalServer:
    """One `pagedserve serve` process (see the module doc)."""

    config: dict[str, Any]
    grace_period_s: float = 5.0
    replicas: int = 1
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="reliability-")))
    extra_args: list[str] = field(default_factory=list)
    """More `pagedserve serve` arguments (a positional model, engine flags)."""
    signal_group: bool = False
    """`signal` sends to the server's whole process group (as systemd, `timeout` or a
    container's init do) instead of to its process alone."""

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "serve.log"

    def start(self, timeout_s: float = 240.0) -> None:
        config_path = self.workdir / "serve_config.yaml"
        config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        ready = self.workdir / "ready"
        command = [
            sys.executable,
            "-m",
            "cluster.serving.cli",
            "serve",
            "--config",
            str(config_path),
            "--host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            "--replicas",
            str(self.replicas),
            "--grace-period",
            str(self.grace_period_s),
            "--ready-file",
            str(ready),
            *self.extra_args,
        ]
        env = {**os.environ, "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the server did not start; log:\n{self.log_tail()}")
            time.sleep(READY_POLL_S)
        self.wait_healthy(deadline)

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(READY_POLL_S)
        raise RuntimeError(f"the server never became healthy; log:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def signal(self, signum: int) -> None:
        assert self.process is not None
        if self.signal_group:
            os.killpg(self.process.pid, signum)  # it leads its group: started in a new session
        else:
            self.process.send_signal(signum)

    def wait(self, timeout_s: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout_s)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM and wait; the process group is killed if it outlives `timeout_s`."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        """SIGKILL to the server's process group and to every process it started (Ray's run in
        a session of their own)."""
        if self.process is not None and self.process.poll() is None:
            descendants = psutil.Process(self.process.pid).children(recursive=True)
            os.killpg(self.process.pid, signal.SIGKILL)
            for process in descendants:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            self.process.wait(30)

    # --- figures --------------------------------------------------------------------------

    def metrics_text(self, headers: dict[str, str] | None = None) -> str:
        return httpx.get(f"{self.base}/metrics", headers=headers, timeout=10).text

    def kv_blocks_used(self, headers: dict[str, str] | None = None, wait_s: float = 10.0) -> float:
        """Device KV blocks in use once the engine is idle (polls up to `wait_s`)."""
        deadline = time.monotonic() + wait_s
        while True:
            used = _sample(self.metrics_text(headers), "pagedserve_kv_cache_blocks", "used")
            if used == 0 or time.monotonic() > deadline:
                return used
            time.sleep(0.2)

    def processes(self, title: str) -> list[psutil.Process]:
        """This server's descendant processes whose command line contains `title` (e.g.
        "ServeReplica:pagedserve:GenerationServer", "WorkerRank")."""
        assert self.process is not None
        found = []
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if title in " ".join(child.cmdline()):
                    found.append(child)
            except psutil.Error:
                continue
        return found

    def rss_bytes(self) -> dict[str, int]:
        """RSS of this server's engine and ingress replica processes (its descendants only)."""
        assert self.process is not None
        rss = {ENGINE: 0, INGRESS: 0}
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                title = " ".join(child.cmdline())
                for name in rss:
                    if f"ServeReplica:pagedserve:{name}" in title:
                        rss[name] += child.memory_info().rss
            except psutil.Error:
                continue
        return rss


def _sample(text: str, name: str, state: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'state="{state}"' in line and 'tier="device"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise LookupError(f"{name}{{state={state},tier=device}} not in /metrics")
