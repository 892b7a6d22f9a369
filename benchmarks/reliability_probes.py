"""The reliability scenarios, each against a `LocalServer` it is given (localhost only, a
bounded number of requests, a time limit on every call): bad-input fuzzing of both front ends,
a body over the limit while /health is polled, deep nesting, a 10x burst, and a signal while
requests are in flight. Each returns a small result the tests assert on and the benchmark
reports.

Invariant: every bad input a fuzzer builds carries at least one value the API must refuse, so
the only right answer is a 4xx in OpenAI's error shape (gRPC: INVALID_ARGUMENT).
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import generation_pb2 as pb

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT_S = 30.0

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)

BAD_SAMPLING: list[tuple[str, Any]] = [
    ("temperature", -1),
    ("temperature", 2.5),
    ("temperature", "0.5"),
    ("temperature", True),
    ("top_p", 0),
    ("top_p", 1.5),
    ("n", 0),
    ("n", 129),
    ("n", "1"),
    ("n", 1.5),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("seed", -1),
    ("stop", ["s"] * 17),
    ("stop", "x" * 1025),
    ("stop", [""]),
    ("stop", 5),
    ("stream", "yes"),
    ("stream_options", {"include_usage": True}),
    ("logit_bias", {"a": 2.0}),
    ("logit_bias", {"1": 101}),
    ("logit_bias", {"4294967296": 1}),
    ("frequency_penalty", 2.5),
    ("presence_penalty", -3),
    ("repetition_penalty", 0),
    ("min_p", 1.5),
    ("min_tokens", -1),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [-1]),
    ("allowed_token_ids", [10**9]),  # outside the vocabulary: the engine refuses it
    ("bad_words", [""]),
    ("bad_words", [" "]),
    ("bad_words", "word"),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", -1),
    ("priority", "1"),
    ("priority", 2**31),
    ("priority", 3),  # the shipped server schedules fcfs: only 0 is taken
    ("min_tokens", 2),  # above the body's max_tokens (1)
    ("model", "gpt-4"),
    ("stop_token_ids", [-1]),
]
BAD_COMPLETION: list[tuple[str, Any]] = [
    ("prompt", []),
    ("prompt", [[]]),
    ("prompt", [-1]),
    ("prompt", 7),
    ("prompt", None),
    ("logprobs", 21),
    ("echo", "yes"),
]
BAD_CHAT: list[tuple[str, Any]] = [
    ("messages", []),
    ("messages", [{"role": "wizard", "content": "x"}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url"}]}]),
    ("messages", [{"content": "x"}]),
    ("messages", "hello"),
    ("top_logprobs", 3),
    ("tools", [{"type": "function"}]),
    ("chat_template_kwargs", {"add_generation_prompt": False}),
    ("chat_template_kwargs", "enable_thinking"),
]


@dataclass
class FuzzResult:
    """Bad inputs sent to one front end and those answered wrongly (not 4xx / not OpenAI's
    error shape; gRPC: not INVALID_ARGUMENT, or not NOT_FOUND for an unknown model)."""

    front_end: str
    tried: int = 0
    wrong: list[str] = field(default_factory=list)


def is_openai_error(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error


def check_http(result: FuzzResult, response: httpx.Response, what: str) -> None:
    result.tried += 1
    if not (400 <= response.status_code < 500 and is_openai_error(response)):
        result.wrong.append(f"{what}: {response.status_code} {response.text[:160]}")


def fuzz_http(base: str, examples: int, headers: dict[str, str] | None = None) -> FuzzResult:
    """`examples` Hypothesis-built bad bodies (JSON with one refused value and random extra
    fields, or bytes that are not a JSON object) to both POST routes."""
    result = FuzzResult("http")
    client = httpx.Client(base_url=base, timeout=TIMEOUT_S, headers=headers)
    chat_bad = st.sampled_from(BAD_SAMPLING + BAD_CHAT)
    completion_bad = st.sampled_from(BAD_SAMPLING + BAD_COMPLETION)
    extra = st.dictionaries(st.sampled_from(["user", "top_k", "suffix", "x", "n", "seed"]), JSON)
    raw = st.binary(max_size=64).filter(lambda b: not b.strip().startswith(b"{")) | st.just(
        b'{"model": '
    )

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        chat=st.booleans(),
        bad=st.tuples(completion_bad, chat_bad),
        fields=extra,
        body=st.none() | raw,
    )
    def one(
        chat: bool, bad: tuple[tuple[str, Any], ...], fields: dict[str, Any], body: bytes | None
    ) -> None:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if body is None:
            request: dict[str, Any] = {"model": MODEL, "max_tokens": 1, **fields}
            request.update(
                {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
            )
            name, value = bad[1] if chat else bad[0]
            request[name] = value
            body = json.dumps(request).encode()
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        check_http(result, response, f"{path} {body[:120]!r}")

    one()
    client.close()
    return result


BAD_PROTO: list[pb.GenerateRequest] = [
    pb.GenerateRequest(),
    pb.GenerateRequest(model="gpt-4", text="x"),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])),
    pb.GenerateRequest(chat=pb.ChatMessages()),
    pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="x")])),
    pb.GenerateRequest(text="hi", priority=3),  # the shipped server schedules fcfs
    pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")]),
        chat_template_kwargs_json='{"messages": []}',
    ),
    pb.GenerateRequest(text="hi", chat_template_kwargs_json="{}"),
]
BAD_PROTO_SAMPLING: list[dict[str, Any]] = [
    {"temperature": math.inf},
    {"temperature": math.nan},
    {"temperature": -1.0},
    {"top_p": 0.0},
    {"top_p": math.nan},
    {"n": 0},
    {"n": 1000},
    {"logprobs": 21},
    {"stop": ["s"] * 1000},
    {"stop": ["x" * 2000]},
    {"stop": [""]},
    {"seed": 2**63},
    {"max_tokens": 0},
    {"max_tokens": 10**6},
    {"presence_penalty": 2.5},
    {"frequency_penalty": -3.0},
    {"repetition_penalty": 0.0},
    {"repetition_penalty": math.inf},
    {"min_p": math.nan},
    {"min_tokens": 17},  # above the default max_tokens (16)
    {"logit_bias": {1: 101.0}},
    {"logit_bias": {2**32 - 1: 1.0}},  # outside the vocabulary: the engine refuses it
    {"allowed_token_ids": [2**32 - 1]},
    {"bad_words": ["ok", " "]},
    {"truncate_prompt_tokens": 0},
    {"prompt_logprobs": 21},
]


def fuzz_grpc(target: str, examples: int, metadata: tuple[tuple[str, str], ...] = ()) -> FuzzResult:
    """`examples` bad Generate calls: a refused sampling value on each prompt kind, a bad
    prompt, or corrupt bytes (a wire type protobuf does not have, then random bytes)."""
    result = FuzzResult("grpc")
    channel = grpc.insecure_channel(target)
    raw_generate = channel.unary_stream("/pagedserve.v1.Generation/Generate")
    prompts = [
        {"text": "hi"},
        {"token_ids": pb.TokenIds(ids=[1, 2])},
        {"chat": pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])},
    ]

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        kind=st.integers(0, 2),
        sampling=st.sampled_from(BAD_PROTO_SAMPLING),
        prompt=st.sampled_from(BAD_PROTO),
        corrupt=st.none() | st.binary(max_size=32).map(lambda b: b"\x0f" + b),
        shape=st.integers(0, 2),
    )
    def one(
        kind: int,
        sampling: dict[str, Any],
        prompt: pb.GenerateRequest,
        corrupt: bytes | None,
        shape: int,
    ) -> None:
        expected = grpc.StatusCode.INVALID_ARGUMENT
        if corrupt is not None and shape == 0:
            data, what = corrupt, f"corrupt {corrupt[:16]!r}"
        elif shape == 1:
            data, what = prompt.SerializeToString(), f"prompt {prompt}"
            if prompt.model:  # a model (or LoRA adapter) not served: HTTP's 404
                expected = grpc.StatusCode.NOT_FOUND
        else:
            request = pb.GenerateRequest(
                **prompts[kind], sampling=pb.SamplingParameters(**sampling)
            )
            data, what = request.SerializeToString(), f"{list(prompts[kind])} {sampling}"
        result.tried += 1
        try:
            list(raw_generate(data, metadata=metadata, timeout=TIMEOUT_S))
            result.wrong.append(f"{what}: OK")
        except grpc.RpcError as error:
            if error.code() != expected:
                result.wrong.append(f"{what}: {error.code()} {error.details()}")

    one()
    channel.close()
    return result


@dataclass
class BodyLimitResult:
    status: int
    openai_shape: bool
    refused_in_s: float
    health_polls: int
    worst_health_s: float
    baseline_health_s: float


def huge_prompt_refusal(
    base: str, size_bytes: int, headers: dict[str, str] | None = None
) -> BodyLimitResult:
    """POSTs a `size_bytes` prompt while a thread polls /health every 20 ms; the worst /health
    latency bounds how long the ingress's event loop stalled."""
    client = httpx.Client(base_url=base, timeout=TIMEOUT_S, headers=headers)
    baseline = []
    for _ in range(10):
        started = time.perf_counter()
        client.get("/health")
        baseline.append(time.perf_counter() - started)
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=base, timeout=TIMEOUT_S) as poller:
            while not done.is_set():
                started = time.perf_counter()
                poller.get("/health")
                latencies.append(time.perf_counter() - started)
                time.sleep(0.02)

    # Built before polling starts: building it holds this process's GIL, not the server's.
    prompt = "word " * (size_bytes // 5)
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    del prompt
    thread = threading.Thread(target=poll)
    thread.start()
    time.sleep(0.2)
    started = time.perf_counter()
    try:
        response = client.post("/v1/completions", content=body)
        status, shape = response.status_code, is_openai_error(response)
    except httpx.HTTPError:
        status, shape = -1, False
    refused_in = time.perf_counter() - started
    time.sleep(0.3)
    done.set()
    thread.join()
    client.close()
    return BodyLimitResult(
        status, shape, refused_in, len(latencies), max(latencies), sorted(baseline)[5]
    )


def deep_nesting(base: str, levels: int, headers: dict[str, str] | None = None) -> httpx.Response:
    body = b'{"model": "m", "prompt": ' + b"[" * levels + b"]" * levels + b"}"
    return httpx.post(f"{base}/v1/completions", content=body, headers=headers, timeout=TIMEOUT_S)


@dataclass
class BurstResult:
    sent: int
    ok: int = 0
    shed: int = 0
    shed_with_retry_after: int = 0
    other: list[str] = field(default_factory=list)
    connect_errors: int = 0
    worst_shed_s: float = 0.0
    worst_any_s: float = 0.0


def burst(
    base: str, requests: int, max_tokens: int, headers: dict[str, str] | None = None
) -> BurstResult:
    """`requests` completions at once (one thread each); counts 200s, 503s with Retry-After in
    OpenAI's shape, anything else, and connection failures."""
    result = BurstResult(requests)
    lock = threading.Lock()
    start = threading.Barrier(requests)

    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": f"burst {i}", "max_tokens": max_tokens}
        body["ignore_eos"] = True
        start.wait()
        began = time.perf_counter()
        try:
            response = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=120)
        except httpx.ConnectError:
            with lock:
                result.connect_errors += 1
            return
        except httpx.HTTPError as error:
            with lock:
                result.other.append(f"{type(error).__name__}: {error}")
            return
        took = time.perf_counter() - began
        with lock:
            result.worst_any_s = max(result.worst_any_s, took)
            if response.status_code == 200:
                result.ok += 1
            elif response.status_code == 503 and is_openai_error(response):
                result.shed += 1
                result.worst_shed_s = max(result.worst_shed_s, took)
                if response.headers.get("retry-after", "").isdigit():
                    result.shed_with_retry_after += 1
            else:
                result.other.append(f"{response.status_code} {response.text[:120]}")

    with ThreadPoolExecutor(requests) as pool:
        list(pool.map(one, range(requests)))
    return result


@dataclass
class ShutdownResult:
    """How a signal with streams in flight went. `error_events`: streams that ended with an
    OpenAI error event followed by `[DONE]`; `error_without_done`: an error event and no
    `[DONE]`; `queued_503`: streams still queued (no output yet) when the drain expired, answered
    with a 503 in OpenAI's shape before the stream began; `cut`: none of these (the connection
    closed mid-stream, or another status)."""

    exit_code: int | None
    seconds_to_exit: float
    streams: int
    completed: int
    error_events: int
    error_without_done: int
    queued_503: int
    cut: int
    refused_after_signal: int
    refused_as_json_503: int
    late_detail: str
    output_tail: str


def stream_outcome(
    base: str, max_tokens: int, headers: dict[str, str] | None, model: str = MODEL
) -> str:
    """'done' ([DONE] seen, no error), 'error' (an OpenAI error event, then [DONE]),
    'error_no_done' (an error event, then the end), 'cut' (neither), 'refused_503' (a 503 in
    OpenAI's shape before the stream began: it was still queued) or 'refused' (another status)."""
    body = {
        "model": model,
        "prompt": "shutdown",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    errored = False
    try:
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=body, headers=headers, timeout=120
        ) as response:
            if response.status_code != 200:
                response.read()
                return "refused_503" if openai_503(response) else "refused"
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    return "error" if errored else "done"
                if line.startswith("data: ") and is_error_event(line):
                    errored = True
    except httpx.HTTPError:
        pass
    return "error_no_done" if errored else "cut"


def is_error_event(line: str) -> bool:
    """An SSE data line holding an error in OpenAI's shape (message, type, code)."""
    try:
        event = json.loads(line.removeprefix("data: "))
    except ValueError:
        return False
    error = event.get("error") if isinstance(event, dict) else None
    return isinstance(error, dict) and bool(error.get("message")) and "type" in error


def openai_503(response: httpx.Response) -> bool:
    return response.status_code == 503 and is_openai_error(response)


def late_request(base: str, headers: dict[str, str] | None) -> tuple[bool, bool, str]:
    """A non-stream request sent while the server drains: (refused, refused with a JSON 503
    in OpenAI's shape and Retry-After, what came back)."""
    body = {"model": MODEL, "prompt": "late", "max_tokens": 2}
    try:
        response = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=30)
    except httpx.HTTPError as error:
        return True, False, f"{type(error).__name__}: {error}"
    json_503 = (
        response.status_code == 503
        and is_openai_error(response)
        and "retry-after" in response.headers
    )
    return response.status_code != 200, json_503, f"{response.status_code} {response.text[:160]}"


def shutdown_under_load(
    server: Any,
    signum: int,
    streams: int,
    max_tokens: int,
    headers: dict[str, str] | None,
    exit_timeout_s: float = 120.0,
) -> ShutdownResult:
    """Starts `streams` streaming requests, signals the server once they run, sends a
    non-stream request while it drains, then counts how each stream ended and the exit."""
    outcomes: list[str] = []
    threads = [
        threading.Thread(
            target=lambda: outcomes.append(stream_outcome(server.base, max_tokens, headers))
        )
        for _ in range(streams)
    ]
    for thread in threads:
        thread.start()
    time.sleep(2.0)
    signalled = time.perf_counter()
    server.signal(signum)
    time.sleep(1.0)
    refused, json_503, detail = late_request(server.base, headers)
    try:
        code: int | None = server.wait(exit_timeout_s)
    except Exception:
        code = None
    seconds = time.perf_counter() - signalled
    for thread in threads:
        thread.join(60)
    return ShutdownResult(
        exit_code=code,
        seconds_to_exit=seconds,
        streams=streams,
        completed=outcomes.count("done"),
        error_events=outcomes.count("error"),
        error_without_done=outcomes.count("error_no_done"),
        queued_503=outcomes.count("refused_503"),
        cut=len(outcomes)
        - sum(outcomes.count(k) for k in ("done", "error", "error_no_done", "refused_503")),
        refused_after_signal=int(refused),
        refused_as_json_503=int(json_503),
        late_detail=detail,
        output_tail=server.log_tail(1500),
    )
