"""What an idle `pagedserve serve` costs an engine on the same machine: the floor under the
served path's overhead (`benchmarks.served_overhead`).

``python -m benchmarks.idle_server_floor --json [--requests 64] [--max-tokens 128]`` runs the
in-process burst of `benchmarks.served_overhead` (``LLM`` with the shipped Serve config's
engine, natural-text chats, greedy, ``ignore_eos``) three times in one run:

- quiet;
- beside an idle ``pagedserve serve`` (started as shipped, after one request);
- beside the same server with every process it started stopped (SIGSTOP), then resumed: the
  control, near the quiet figure when what costs is the server's processes running (each wake-up
  on a core stalls the forward pass's threads at their next barrier), not its memory.

It prints each run's output tok/s and TPOT p50, ``idle_server_tok_s_over_quiet`` and
``stopped_server_tok_s_over_quiet``, and the server's Ray worker processes by what they run
(every one of them wakes about 100 times a second, idle or not).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

from benchmarks.chat_corpus import chat_prompts
from benchmarks.load import Job, run_workload
from benchmarks.ports import free_port
from benchmarks.served_overhead import (
    MODEL_NAME,
    http_server,
    render_chats,
    run_in_process,
    serve_command,
    side_ratio,
)
from cluster.serving.cli_serve import served_app_args


def server_processes(leader: int) -> list[Any]:
    """The server's process and everything it started (Ray's processes included)."""
    import psutil

    root = psutil.Process(leader)
    return [root, *root.children(recursive=True)]


def ray_workers(processes: list[Any]) -> list[str]:
    """What each Ray worker process runs ("ServeReplica", "KVDirectory", ...), sorted."""
    names = []
    for process in processes:
        with contextlib.suppress(Exception):
            title = (process.cmdline() or [""])[0]
            if title.startswith("ray::"):
                names.append(re.split(r"[.:\s]", title.removeprefix("ray::"))[0])
    return sorted(names)


@contextlib.contextmanager
def stopped(processes: list[Any]) -> Iterator[None]:
    """Every process in `processes` stopped (SIGSTOP) while the block runs, resumed after."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    config = served_app_args(()).engine_config()
    prompts = render_chats(config, chat_prompts(args.requests, args.seed))
    quiet = run_in_process(config, prompts, args.max_tokens)

    port = free_port()
    command = serve_command(port)
    with http_server(command, port, args.ready_timeout) as (server, url):
        one = [Job(prompts[0], 8)]
        asyncio.run(run_workload(url, MODEL_NAME, "none", one, math.inf, 0, "one request"))
        processes = server_processes(server.pid)
        workers = ray_workers(processes)
        beside_idle = run_in_process(config, prompts, args.max_tokens)
        with stopped(processes):
            beside_stopped = run_in_process(config, prompts, args.max_tokens)
    out = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "quiet": quiet,
        "beside_idle_server": beside_idle,
        "beside_stopped_server": beside_stopped,
        "server_processes": len(processes),
        "server_ray_workers": workers,
        "idle_server_tok_s_over_quiet": side_ratio(beside_idle, quiet, "output_tok_s"),
        "stopped_server_tok_s_over_quiet": side_ratio(beside_stopped, quiet, "output_tok_s"),
    }
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
