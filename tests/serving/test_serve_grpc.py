"""The gRPC API through Ray Serve's own gRPC proxy, with the committed stubs: streaming Generate
against HF greedy decoding, Tokenize, model info, cache stats, the health service, status codes,
and a cancelled call freeing its blocks."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import generation_pb2 as pb
from protos import generation_pb2_grpc as pb_grpc
from tests.serving.conftest import MAX_MODEL_LEN, MODEL, GreedyOracle, Served

KEY = (("authorization", "Bearer key-alice"),)


@pytest.fixture(scope="module")
def channel(served: Served) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(served.grpc_target) as opened:
        yield opened


@pytest.fixture
def stub(channel: grpc.Channel) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(channel)


def greedy(max_tokens: int, **extra: object) -> pb.SamplingParameters:
    return pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def test_generate_streams_hf_greedy_tokens_and_ends_with_usage(
    stub: pb_grpc.GenerationStub, oracle: GreedyOracle
) -> None:
    prompt = "The capital of France is"
    ids = oracle.prompt_ids(prompt)
    expected, expected_logprobs = oracle.generate(ids, 6)
    request = pb.GenerateRequest(model=MODEL, text=prompt, sampling=greedy(6, logprobs=2))
    responses = list(stub.Generate(request, metadata=KEY))
    assert len(responses) > 1  # streamed, not one blob
    deltas = [choice for r in responses for choice in r.choices]
    assert [t for d in deltas for t in d.token_ids] == expected
    assert "".join(d.text for d in deltas) == oracle.text(expected)
    logprobs = [p.sampled.logprob for d in deltas for p in d.logprobs]
    assert logprobs == pytest.approx(expected_logprobs, abs=2e-3)
    final = responses[-1]
    assert final.finished and not any(r.finished for r in responses[:-1])
    assert final.choices[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(ids), 6)


def test_generate_from_chat_and_token_ids(
    stub: pb_grpc.GenerationStub, oracle: GreedyOracle
) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages])
    expected, _ = oracle.generate(oracle.prompt_ids(messages), 4)
    for request in (
        pb.GenerateRequest(chat=chat, sampling=greedy(4)),
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=oracle.prompt_ids(messages)), sampling=greedy(4)
        ),
    ):
        tokens = [
            t for r in stub.Generate(request, metadata=KEY) for c in r.choices for t in c.token_ids
        ]
        assert tokens == expected


def test_stop_string_is_reported_as_the_stop_reason(
    stub: pb_grpc.GenerationStub, oracle: GreedyOracle
) -> None:
    full = oracle.text(oracle.generate(oracle.prompt_ids("Numbers:"), 10)[0])
    stop = full[4:7]
    request = pb.GenerateRequest(text="Numbers:", sampling=greedy(10, stop=[stop]))
    responses = list(stub.Generate(request, metadata=KEY))
    last = responses[-1].choices[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert last.stop_string == stop
    assert "".join(c.text for r in responses for c in r.choices) == full[: full.index(stop)]


def test_tokenize_model_info_and_cache_stats(
    stub: pb_grpc.GenerationStub, oracle: GreedyOracle
) -> None:
    text = "Hello world"
    tokenized = stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=True), metadata=KEY)
    assert list(tokenized.token_ids) == oracle.prompt_ids(text)
    assert tokenized.max_model_len == MAX_MODEL_LEN
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)])
    templated = stub.Tokenize(pb.TokenizeRequest(chat=chat), metadata=KEY)
    assert list(templated.token_ids) == oracle.prompt_ids([{"role": "user", "content": text}])

    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=KEY)
    assert (info.model, info.max_model_len, info.block_size) == (MODEL, MAX_MODEL_LEN, 4)
    assert info.vocab_size == len(oracle.tokenizer) and len(info.weights_digest) == 64
    assert info.architecture == "llama"  # the tiny model's config.json model_type

    stats = stub.GetCacheStats(pb.GetCacheStatsRequest(), metadata=KEY)
    device = next(t for t in stats.tiers if t.name == "device")
    assert device.total_blocks == 256
    assert device.free_blocks + device.cached_blocks + device.used_blocks == 256


def test_health_service_reports_serving(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pagedserve.v1.Generation"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as caught:
        health.Check(health_pb2.HealthCheckRequest(service="nope.Service"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("request_", "metadata", "code", "fragment"),
    [
        (pb.GenerateRequest(text="x"), (), grpc.StatusCode.UNAUTHENTICATED, "API key"),
        (
            pb.GenerateRequest(text="x"),
            (("authorization", "Bearer wrong"),),
            grpc.StatusCode.UNAUTHENTICATED,
            "not valid",
        ),
        (pb.GenerateRequest(), KEY, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (
            pb.GenerateRequest(text="x", sampling=pb.SamplingParameters(top_p=2)),
            KEY,
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p",
        ),
        (
            pb.GenerateRequest(model="gpt-4", text="x"),
            KEY,
            grpc.StatusCode.NOT_FOUND,
            "gpt-4",
        ),
        (
            pb.GenerateRequest(adapter="no-such-adapter", text="x"),
            KEY,
            grpc.StatusCode.NOT_FOUND,
            "no-such-adapter",
        ),
        (
            pb.GenerateRequest(text="word " * (MAX_MODEL_LEN + 5)),
            KEY,
            grpc.StatusCode.INVALID_ARGUMENT,
            "context",
        ),
        (
            pb.GenerateRequest(text="x", sampling=pb.SamplingParameters(max_tokens=MAX_MODEL_LEN)),
            KEY,
            grpc.StatusCode.INVALID_ARGUMENT,
            "maximum context length",
        ),
    ],
)
def test_status_codes(
    stub: pb_grpc.GenerationStub,
    request_: pb.GenerateRequest,
    metadata: tuple[tuple[str, str], ...],
    code: grpc.StatusCode,
    fragment: str,
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request_, metadata=metadata))
    assert caught.value.code() == code
    assert fragment in caught.value.details()


def test_cancelling_a_call_aborts_the_request_and_frees_its_blocks(
    served: Served, stub: pb_grpc.GenerationStub
) -> None:
    before = served.wait_until_idle()
    call = stub.Generate(pb.GenerateRequest(text="Go on", sampling=greedy(400)), metadata=KEY)
    for _ in range(3):
        next(call)
    during = served.metrics()
    assert during["pagedserve_sequences{queue=running}"] == 1
    call.cancel()
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    after = served.wait_until_idle()
    assert after["pagedserve_kv_cache_blocks{state=used,tier=device}"] == 0
    finished = "pagedserve_requests_total{outcome=finished}"
    generated = "pagedserve_generated_tokens_total{}"
    assert after[finished] == before[finished]  # aborted, not run to its end
    aborted = "pagedserve_requests_total{outcome=aborted}"
    assert after[aborted] == before[aborted] + 1
    assert after[generated] - before[generated] < 400


def test_twenty_cancels_at_varying_points_all_abort_their_requests(
    served: Served, stub: pb_grpc.GenerationStub
) -> None:
    """Serve's proxy lost a cancel that landed while it wrote a message (about 1 in 10 before
    cluster/serving/grpc_proxy_cancel.py): none may run on to its end."""
    before = served.wait_until_idle()
    for i in range(20):
        call = stub.Generate(pb.GenerateRequest(text="Go on", sampling=greedy(400)), metadata=KEY)
        for _ in range(1 + i % 5):
            next(call)
        call.cancel()
        served.wait_until_idle()
    after = served.wait_until_idle()
    finished = "pagedserve_requests_total{outcome=finished}"
    aborted = "pagedserve_requests_total{outcome=aborted}"
    assert after[finished] == before[finished]
    assert after[aborted] == before[aborted] + 20
    assert after["pagedserve_kv_cache_blocks{state=used,tier=device}"] == 0


def test_admission_refusal_is_resource_exhausted(
    served: Served, stub: pb_grpc.GenerationStub
) -> None:
    def run(_: int) -> grpc.StatusCode:
        request = pb.GenerateRequest(text="Go", sampling=greedy(80))
        try:
            list(stub.Generate(request, metadata=KEY))
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    # 24 at once against 4 running + 3 waiting: some must be refused, however they interleave.
    with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
        codes = list(pool.map(run, range(24)))
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert served.wait_until_idle()["pagedserve_kv_cache_blocks{state=used,tier=device}"] == 0
