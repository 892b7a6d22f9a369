"""The OpenAI-compatible HTTP API of the Serve app on a real local Ray cluster with the tiny model,
driven by the official `openai` client (and raw httpx where the wire itself is under test).
Greedy results are checked against HF transformers on the same weights."""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
from typing import Any

import httpx
import openai
import pytest

from tests.serving.conftest import MAX_MODEL_LEN, MODEL, GreedyOracle, Served

ALICE = {"Authorization": "Bearer key-alice"}


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http_base}/v1", api_key="key-alice", max_retries=0)


def test_completion_equals_hf_greedy(client: openai.OpenAI, oracle: GreedyOracle) -> None:
    prompt = "The capital of France is"
    ids = oracle.prompt_ids(prompt)
    expected_ids, _ = oracle.generate(ids, 8)
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    (choice,) = response.choices
    assert choice.text == oracle.text(expected_ids)
    assert choice.finish_reason == "length"
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 8)


def test_streamed_completion_is_the_same_text_and_ends_with_done(
    served: Served, client: openai.OpenAI
) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 7, "temperature": 0}
    whole = client.completions.create(**body).choices[0].text
    events = []
    with httpx.stream(
        "POST",
        f"{served.http_base}/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        headers=ALICE,
        timeout=30,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole
    assert [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
    streamed = client.completions.create(**body, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole


def test_chat_equals_hf_greedy_with_logprobs_and_streams_role_first(
    client: openai.OpenAI, oracle: GreedyOracle
) -> None:
    messages: list[Any] = [{"role": "user", "content": "Name a colour."}]
    expected_ids, expected_logprobs = oracle.generate(oracle.prompt_ids(messages), 6)
    response = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == oracle.text(expected_ids)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    served_logprobs = [entry.logprob for entry in choice.logprobs.content]
    assert served_logprobs == pytest.approx(expected_logprobs, abs=2e-3)
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_n_seeded_choices_are_reproducible(client: openai.OpenAI) -> None:
    def ask() -> Any:
        return client.completions.create(
            model=MODEL, prompt="Hello", n=3, max_tokens=5, seed=7, extra_body={"ignore_eos": True}
        )

    first, second = ask(), ask()
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # sampled branches differ
    assert first.usage is not None and first.usage.completion_tokens == 15


def test_streamed_n_choices_equal_the_non_streamed_ones(client: openai.OpenAI) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": "Hi", "n": 2, "max_tokens": 6, "seed": 3}
    whole = {c.index: c.text for c in client.completions.create(**body).choices}
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in client.completions.create(**body, stream=True):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == whole
    assert all(len(reasons) == 1 for reasons in finishes.values())  # each finish reported once


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI, oracle: GreedyOracle) -> None:
    prompt = "A list of fruits:"
    full = oracle.text(oracle.generate(oracle.prompt_ids(prompt), 12)[0])
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    (choice,) = response.choices
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop"


def test_batched_and_token_id_prompts(client: openai.OpenAI, oracle: GreedyOracle) -> None:
    prompts = ["Red", "Green light"]
    response = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0
    )
    by_index = {c.index: c.text for c in response.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        expected = oracle.text(oracle.generate(oracle.prompt_ids(prompt), 4)[0])
        assert by_index[2 * i] == by_index[2 * i + 1] == expected
    ids = oracle.prompt_ids("Green light")
    from_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert from_ids.choices[0].text == by_index[2]


def post(served: Served, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{served.http_base}{path}",
        content=content,
        headers={"content-type": "application/json", **(ALICE if headers is None else headers)},
        timeout=30,
    )


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG_PROMPT = "word " * (MAX_MODEL_LEN + 10)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "prompt"),
        (COMPLETIONS, {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
        (CHAT, {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "messages[0].role"),
        (CHAT, {"model": MODEL, "messages": "hello"}, 400, "messages"),
        (COMPLETIONS, {"model": MODEL, "prompt": "x", "n": "2"}, 400, "n"),
        (COMPLETIONS, {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        (COMPLETIONS, b'{"model": "tiny", "prompt": ', 400, None),
        (COMPLETIONS, {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ],
)
def test_bad_input_is_a_400_with_openais_error_body(
    served: Served, path: str, body: Any, status: int, param: str | None
) -> None:
    response = post(served, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_an_unknown_model_is_a_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert caught.value.code == "model_not_found"
    assert caught.value.body["param"] == "model"  # type: ignore[index]
    assert caught.value.body["type"] == "NotFoundError"  # type: ignore[index]


def test_context_overflow_is_reported_like_openai(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN)
    assert caught.value.code == "context_length_exceeded"
    assert "maximum context length" in caught.value.message


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "x"}])
def test_a_missing_or_wrong_api_key_is_a_401(served: Served, headers: dict[str, str]) -> None:
    response = post(served, COMPLETIONS, {"model": MODEL, "prompt": "x"}, headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=f"{served.http_base}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_admission_refusal_is_a_503_with_retry_after(served: Served) -> None:
    body = {"model": MODEL, "prompt": "Go", "max_tokens": 40, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        responses = list(pool.map(lambda _: post(served, COMPLETIONS, body), range(16)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 503}, statuses
    refused = next(r for r in responses if r.status_code == 503)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "engine_overloaded"
    assert served.wait_until_idle()["pagedserve_kv_cache_blocks{state=used,tier=device}"] == 0


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(served: Served) -> None:
    before = served.wait_until_idle()
    body = {"model": MODEL, "prompt": "Tell", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{served.http_base}{COMPLETIONS}", json=body, headers=ALICE, timeout=30
    ) as response:
        lines = response.iter_lines()  # kept alive: closing it would close the connection
        events = 0
        while events < 3:
            events += next(lines).startswith("data: ")
        during = served.metrics()
        assert during["pagedserve_sequences{queue=running}"] == 1
        assert during["pagedserve_kv_cache_blocks{state=used,tier=device}"] > 0
    after = served.wait_until_idle()
    assert after["pagedserve_kv_cache_blocks{state=used,tier=device}"] == 0
    assert after["pagedserve_sequences{queue=running}"] == 0
    # aborted, not finished: it generated far fewer than 400 tokens
    finished = "pagedserve_requests_total{outcome=finished}"
    assert after[finished] == before[finished]
    generated = "pagedserve_generated_tokens_total{}"
    assert after[generated] - before[generated] < 400


def test_tenants_never_share_cached_blocks(served: Served) -> None:
    prompt = "A long shared system prompt that fills several KV blocks for caching. " * 3

    def cached_tokens(key: str) -> int:
        headers = {"Authorization": f"Bearer {key}"}
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        usage = post(served, COMPLETIONS, body, headers).json()["usage"]
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    assert cached_tokens("key-alice") == 0  # nobody sent this prompt before
    assert cached_tokens("key-alice") > 0  # the same tenant hits its own blocks
    assert cached_tokens("key-alice-2") > 0  # another key of the same tenant too
    assert cached_tokens("key-bob") == 0  # another tenant never does
    assert cached_tokens("key-bob") > 0


def test_models_health_and_metrics(
    served: Served, client: openai.OpenAI, tiny_model_dir: pathlib.Path
) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL
    # vLLM's card fields: where the model was loaded from and the context a request may fill;
    # and the family that runs it, the one the checkpoint's config.json names
    card = model.model_dump()
    assert (card["root"], card["max_model_len"]) == (str(tiny_model_dir), MAX_MODEL_LEN)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert card["architecture"] == config["model_type"] == "llama"
    assert httpx.get(f"{served.http_base}/health").status_code == 200
    samples = served.metrics()
    capacity = samples["pagedserve_kv_cache_capacity_blocks{tier=device}"]
    states = [
        samples[f"pagedserve_kv_cache_blocks{{state={s},tier=device}}"]
        for s in ("free", "cached", "used")
    ]
    assert capacity == 256 == sum(states)
    assert samples["pagedserve_time_to_first_token_seconds_count{}"] > 0
    assert 0 <= samples["pagedserve_prefix_cache_hit_ratio{}"] <= 1
    assert "pagedserve_preemptions_total{mode=swap}" in samples


@pytest.mark.parametrize(
    ("method", "path", "status"), [("GET", COMPLETIONS, 405), ("POST", "/v1/x", 404)]
)
def test_routing_errors_use_openais_error_body_too(
    served: Served, method: str, path: str, status: int
) -> None:
    response = httpx.request(method, f"{served.http_base}{path}", headers=ALICE, timeout=30)
    assert response.status_code == status
    assert path in response.json()["error"]["message"]
