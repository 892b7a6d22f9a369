"""Fault scenarios against a `LocalServer` (localhost, bounded request counts and waits): a
process of the server killed with SIGKILL while requests run, e.g. an engine replica or one
tensor-parallel rank of it.

`kill_under_load` sends streaming and non-stream requests at a fixed rate, kills, then probes
with small requests at a fixed period until serving resumes (and for a while after, to see any
gap), and reports how every request ended:

- a stream ends `done` ([DONE]), `error` (an error event in OpenAI's shape, then [DONE]),
  `error_no_done` (the error event, then the connection closed) or `cut` (neither, or no 200
  and no JSON 503: the goal is 0); one still queued at the kill is refused with a JSON 503
  before it began (`refused_json_503`);
- a non-stream call gets 200, a JSON 503 in OpenAI's shape (the goal for a failed one), or
  something else (listed).

Invariant: every request and wait has a time limit; only the server's own processes are killed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from benchmarks.reliability_probes import MODEL, is_openai_error, stream_outcome

ENGINE_TITLE = "ServeReplica:pagedserve:GenerationServer"
RANK_TITLE = "WorkerRank"


@dataclass
class FaultResult:
    """How the requests in flight at a kill ended, and how long serving took to resume."""

    killed: str = ""
    streams: int = 0
    completed: int = 0
    error_events: int = 0
    error_without_done: int = 0
    refused_json_503: int = 0
    """Streams still queued at the kill: refused before they began, with a JSON 503."""
    cut: int = 0
    unary: int = 0
    unary_ok: int = 0
    unary_json_503: int = 0
    unary_other: list[str] = field(default_factory=list)
    seconds_to_notice: float | None = None
    """Kill -> the first stream that ended with an error event (None: none did)."""
    seconds_to_resume: float | None = None
    """Kill -> the first probe answered 200 (None: not within the limit)."""
    probes_sent: int = 0
    probes_failed: int = 0
    """Probes (new requests sent after the kill) answered otherwise than 200: the gap."""
    probe_failures: list[str] = field(default_factory=list)
    health_after_kill: str = ""


def busiest(processes: list[psutil.Process], sample_s: float = 0.5) -> psutil.Process:
    """The process that used the most CPU over `sample_s` (the one running the requests)."""
    for process in processes:
        process.cpu_percent(None)
    time.sleep(sample_s)
    return max(processes, key=lambda process: process.cpu_percent(None))


def kill_engine_replica(server: Any) -> str:
    """SIGKILL the busiest engine replica process of `server`; returns what was killed."""
    victim = busiest(server.processes(ENGINE_TITLE))
    os.kill(victim.pid, signal.SIGKILL)
    return f"engine replica pid {victim.pid}"


def kill_rank(server: Any) -> str:
    """SIGKILL the last tensor-parallel rank actor process of `server`."""
    ranks = server.processes(RANK_TITLE)
    if not ranks:
        raise RuntimeError("no WorkerRank process: is tensor_parallel_size > 1 with backend ray?")
    victim = ranks[-1]
    os.kill(victim.pid, signal.SIGKILL)
    return f"rank actor pid {victim.pid} of {len(ranks)}"


def unary_outcome(base: str, max_tokens: int, model: str = MODEL) -> str:
    """'ok', 'json_503' or what came back."""
    body = {"model": model, "prompt": "fault", "max_tokens": max_tokens, "ignore_eos": True}
    try:
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    except httpx.HTTPError as error:
        return f"{type(error).__name__}: {error}"
    if response.status_code == 200:
        return "ok"
    if response.status_code == 503 and is_openai_error(response):
        return "json_503"
    return f"{response.status_code} {response.text[:120]}"


def health_after_kill(base: str, wait_s: float = 5.0, period_s: float = 0.1) -> str:
    """`/health`'s first answer other than 200 within `wait_s` of a kill (the replica learns of
    a dead rank only when its step in flight fails, which on a loaded machine takes a moment),
    else its last answer."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            health = httpx.get(f"{base}/health", timeout=10)
            answer = f"{health.status_code} {health.text[:120]}"
            if health.status_code != 200:
                return answer
        except httpx.HTTPError as error:
            answer = type(error).__name__
        if time.monotonic() >= deadline:
            return answer
        time.sleep(period_s)


def kill_under_load(
    server: Any,
    kill: Callable[[Any], str],
    *,
    streams: int = 6,
    unary: int = 2,
    rate_per_s: float = 4.0,
    max_tokens: int = 400,
    probe_period_s: float = 0.25,
    probe_for_s: float = 8.0,
    resume_timeout_s: float = 120.0,
    model: str = MODEL,
) -> FaultResult:
    """Sends `streams` streaming and `unary` non-stream requests for `model` at `rate_per_s`,
    kills with `kill` one second after the last was sent, and probes (see the module doc)."""
    result = FaultResult(streams=streams, unary=unary)
    ends: list[tuple[str, float]] = []
    unary_ends: list[str] = []

    def one_stream() -> None:
        ends.append((stream_outcome(server.base, max_tokens, None, model), time.monotonic()))

    def one_unary() -> None:
        unary_ends.append(unary_outcome(server.base, max_tokens, model))

    kinds = [one_stream] * streams + [one_unary] * unary
    kinds = kinds[::2] + kinds[1::2]  # interleave the two kinds over the sending window
    threads = [threading.Thread(target=kind) for kind in kinds]
    for thread in threads:
        thread.start()
        time.sleep(1.0 / rate_per_s)
    time.sleep(1.0)
    result.killed = kill(server)
    killed_at = time.monotonic()

    def watch_health() -> None:
        result.health_after_kill = health_after_kill(server.base)

    health_watch = threading.Thread(target=watch_health)  # beside the probes: no gap hidden
    health_watch.start()
    probe(server.base, result, killed_at, probe_period_s, probe_for_s, resume_timeout_s, model)
    for thread in threads:
        thread.join(resume_timeout_s)
    health_watch.join(30.0)
    errors = [at for outcome, at in ends if outcome in ("error", "error_no_done")]
    if errors:
        result.seconds_to_notice = round(min(errors) - killed_at, 3)
    outcomes = [outcome for outcome, _ in ends]
    result.completed = outcomes.count("done")
    result.error_events = outcomes.count("error")
    result.error_without_done = outcomes.count("error_no_done")
    result.refused_json_503 = outcomes.count("refused_503")
    ended = result.completed + result.error_events + result.error_without_done
    result.cut = streams - ended - result.refused_json_503
    result.unary_ok = unary_ends.count("ok")
    result.unary_json_503 = unary_ends.count("json_503")
    result.unary_other = [o for o in unary_ends if o not in ("ok", "json_503")][:5]
    return result


def probe(
    base: str,
    result: FaultResult,
    killed_at: float,
    period_s: float,
    for_s: float,
    timeout_s: float,
    model: str = MODEL,
) -> None:
    """Small non-stream requests every `period_s` from the kill until one succeeded and
    `for_s` passed (or `timeout_s`): the first success and every failure are recorded."""
    while True:
        now = time.monotonic()
        resumed = result.seconds_to_resume is not None
        if (resumed and now - killed_at >= for_s) or now - killed_at >= timeout_s:
            return
        outcome = unary_outcome(base, 4, model)
        result.probes_sent += 1
        if outcome == "ok":
            if not resumed:
                result.seconds_to_resume = round(time.monotonic() - killed_at, 2)
        else:
            result.probes_failed += 1
            if len(result.probe_failures) < 3:
                result.probe_failures.append(outcome)
        time.sleep(period_s)
