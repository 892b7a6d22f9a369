"""Find, build and run llama.cpp's `llama-server`: the CPU peer of `benchmarks.vs_llamacpp`.

The binary is looked up in this order: an explicit path (`--llama-server`), the
`PAGEDSERVE_LLAMA_SERVER` environment variable, the build cache
(`$XDG_CACHE_HOME/pagedserve/llama.cpp/bin/llama-server`, `~/.cache` by default), `llama-server`
on PATH. When none exists it is built into the cache from the llama-cpp-python sdist on PyPI
(whose `vendor/llama.cpp` is a pinned llama.cpp): pip download, untar, cmake configure with native
CPU flags, build the `llama-server` target (about 5 minutes on 2 cores).

Invariants: the build never writes inside the repository; a build that cannot run (no cmake, no
compiler, no network) returns a reason instead of raising, so the benchmark can skip cleanly;
every server started here is stopped (its whole process group) when the context exits.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
"""The llama-cpp-python sdist whose vendored llama.cpp is built (pinned: results must compare)."""
ENV_VAR = "PAGEDSERVE_LLAMA_SERVER"


def cache_dir() -> Path:
    """Where the build lives: outside the repository, shared between checkouts."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedserve" / "llama.cpp"


def _executable(candidate: str | Path | None) -> Path | None:
    if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
        return Path(candidate)
    return None


def find_llama_server(explicit: str | None = None) -> Path | None:
    """An existing executable `llama-server`, or None (an explicit path must exist)."""
    if explicit:
        return _executable(Path(explicit).expanduser())
    candidates = [os.environ.get(ENV_VAR), str(cache_dir() / "bin" / "llama-server")]
    candidates.append(shutil.which("llama-server"))
    for candidate in candidates:
        if (found := _executable(candidate)) is not None:
            return found
    return None


def find_llama_tool(name: str, explicit: str | None, env_var: str) -> Path | None:
    """Another llama.cpp binary (`llama-quantize`, `llama-batched-bench`): `explicit`, else
    `$env_var`, else beside the `llama-server` that `find_llama_server` finds, else on PATH."""
    if explicit:
        return _executable(Path(explicit).expanduser())
    server = find_llama_server()
    candidates = [os.environ.get(env_var), server.parent / name if server else None]
    candidates.append(shutil.which(name))
    for candidate in candidates:
        if (found := _executable(candidate)) is not None:
            return found
    return None


def _run(command: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True)


def build_llama_server(
    dest: Path | None = None, jobs: int | None = None
) -> tuple[Path | None, str]:
    """Builds `llama-server` into `dest` (default `cache_dir()`); (binary, "") or (None, why).
    The build log is `dest/build.log`."""
    dest = dest or cache_dir()
    if shutil.which("cmake") is None:
        return None, "cmake is not installed (apt-get install cmake, or pip install cmake)"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return None, "no C++ compiler on PATH (apt-get install g++)"
    source_dir = dest / "src"
    source_dir.mkdir(parents=True, exist_ok=True)
    log = dest / "build.log"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    print(f"building llama-server into {dest} (about 5 minutes; log: {log})", file=sys.stderr)
    try:
        sdist = source_dir / f"{name}.tar.gz"
        if not sdist.is_file():
            _run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                 ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(source_dir)],
                log,
            )  # fmt: skip
        with tarfile.open(sdist) as archive:
            archive.extractall(source_dir, filter="data")
        build = dest / "build"
        _run(
            ["cmake", "-S", str(source_dir / name / "vendor" / "llama.cpp"), "-B", str(build),
             "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DCMAKE_BUILD_TYPE=Release"],
            log,
        )  # fmt: skip
        cores = str(jobs or os.cpu_count() or 2)
        _run(["cmake", "--build", str(build), "-j", cores, "--target", "llama-server"], log)
    except (OSError, subprocess.CalledProcessError, tarfile.TarError) as error:
        return None, f"building llama-server failed ({error}); see {log}"
    binary = dest / "bin" / "llama-server"
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(dest / "build" / "bin" / "llama-server", binary)
    return binary, ""


def wait_ready(url: str, deadline_s: float, process: subprocess.Popen[bytes] | None) -> None:
    """Polls `url` until it answers 200; raises RuntimeError past the deadline or if the
    process exits first."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode} before ready")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready after {deadline_s:.0f} s")


@contextmanager
def server_process(
    command: list[str], ready_url: str, log: Path, ready_s: float, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Starts `command` in its own process group, waits until `ready_url` answers, and on exit
    sends SIGINT to the group, then SIGKILL to whatever is left after 30 s."""
    with log.open("ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        wait_ready(ready_url, ready_s, process)
        yield process
    finally:
        stop_group(process)


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Interrupts the process group led by `process`, killing it after `grace_s`."""
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGINT:
            try:  # the leader is gone; children (Ray workers) may linger a moment
                time.sleep(1.0)
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return
