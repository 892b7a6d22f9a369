"""The committed gRPC stubs match the `.proto`, and the service has the shape the API promises."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2
from ray.serve.config import gRPCOptions

from cluster.engine.sampling_params import SamplingParams
from protos import generate, generation_pb2, generation_pb2_grpc


@pytest.mark.parametrize("proto_file", generate.PROTO_FILES)
def test_committed_stubs_equal_freshly_generated_ones(proto_file: str, tmp_path: Path) -> None:
    written = generate.generate(tmp_path)
    names = generate.generated_names(proto_file)
    assert {tmp_path / name for name in names} <= set(written)
    for name in names:
        fresh = (tmp_path / name).read_bytes()
        committed = (generate.REPO_ROOT / name).read_bytes()
        assert fresh == committed, f"{name} is stale: run `python -m protos.generate`"


def test_a_proto_edit_is_detected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: an edited copy of the proto generates different bytes."""
    edited_root = tmp_path / "edited"
    (edited_root / "protos").mkdir(parents=True)
    source = (generate.REPO_ROOT / "protos/generation.proto").read_text()
    edited = source.replace("bool ignore_eos = 10;", "bool ignore_eos = 10;\n  bool echo = 99;")
    assert edited != source
    (edited_root / "protos/generation.proto").write_text(edited)
    monkeypatch.setattr(generate, "REPO_ROOT", edited_root)
    out = tmp_path / "out"
    generate.generate(out)
    committed = (Path(generate.__file__).parent / "generation_pb2.py").read_bytes()
    assert (out / "protos/generation_pb2.py").read_bytes() != committed


def test_service_is_versioned_and_generate_streams() -> None:
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "pagedserve.v1.Generation"
    streaming = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert streaming == {
        "Generate": (False, True),
        "Tokenize": (False, False),
        "GetModelInfo": (False, False),
        "GetCacheStats": (False, False),
    }


def test_sampling_parameters_mirror_the_engine_fields_with_presence() -> None:
    fields = generation_pb2.SamplingParameters.DESCRIPTOR.fields_by_name
    expected = {
        "n",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "logprobs",
        "ignore_eos",
        "include_stop_str_in_output",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "min_tokens",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "truncate_prompt_tokens",
        "prompt_logprobs",
    }
    assert set(fields) == expected
    # Every engine field the proto names is a SamplingParams field of the same name.
    assert expected <= {f.name for f in dataclasses.fields(SamplingParams)}
    # Unset scalars must be distinguishable from zero (temperature 0 means greedy; repetition
    # penalty 0 is invalid, unset is 1).
    params = generation_pb2.SamplingParameters()
    for name in ("temperature", "presence_penalty", "repetition_penalty", "min_tokens"):
        assert not params.HasField(name)
        setattr(params, name, 0)
        assert params.HasField(name)
    params.logit_bias[50256] = -100.0
    assert dict(params.logit_bias) == {50256: -100.0}


def test_generate_request_round_trips_through_the_wire_and_json() -> None:
    request = generation_pb2.GenerateRequest(
        model="m",
        chat=generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role="user", content="hi")]
        ),
        sampling=generation_pb2.SamplingParameters(n=2, max_tokens=5, stop=["\n"], seed=7),
    )
    decoded = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert decoded.WhichOneof("prompt") == "chat"
    as_json = json_format.MessageToDict(decoded)
    assert as_json["sampling"] == {"n": 2, "maxTokens": 5, "stop": ["\n"], "seed": "7"}


def test_ray_serve_grpc_options_import_the_servicer_functions() -> None:
    """Serve's proxy imports these by path; both must resolve to the generated add-functions."""
    options = gRPCOptions(
        port=9000,
        grpc_servicer_functions=[
            "protos.generation_pb2_grpc.add_GenerationServicer_to_server",
            "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
        ],
    )
    callables = options.grpc_servicer_func_callable
    assert callables[0] is generation_pb2_grpc.add_GenerationServicer_to_server
    assert callables[1].__name__ == "add_HealthServicer_to_server"
    assert health_pb2.HealthCheckResponse.SERVING == 1
