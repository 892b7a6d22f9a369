"""A request's `priority` on both front ends (no Ray: the in-process ingress): HTTP's extra body
field on completions and chat, gRPC's `GenerateRequest.priority`. An fcfs server refuses a
non-zero one as vLLM does (400 naming `priority` / INVALID_ARGUMENT); a priority server takes
it; a value outside int32 is a 400 on HTTP (gRPC's field cannot hold one)."""

from __future__ import annotations

import asyncio
import pathlib

import grpc
import pytest

from cluster.serving.app_args import ServeAppArgs
from cluster.serving.grpc_service import GenerationRpc
from cluster.serving.grpc_validation import GrpcAbort
from protos import generation_pb2 as pb
from tests.serving.conftest import MODEL, engine_section
from tests.serving.test_front_end_server import front_end


def args_with(model_dir: pathlib.Path, policy: str) -> ServeAppArgs:
    engine = engine_section(model_dir)
    engine["scheduler"] = {**engine["scheduler"], "scheduling_policy": policy}
    return ServeAppArgs.model_validate({"served_model_name": MODEL, "engine": engine})


async def grpc_texts(rpc: GenerationRpc, priority: int) -> str:
    request = pb.GenerateRequest(
        text="Hello", sampling=pb.SamplingParameters(max_tokens=3, temperature=0), priority=priority
    )
    texts = []
    async for response in rpc.generate(request, request_id="g", tenant_salt=None):
        texts.extend(choice.text for choice in response.choices)
    return "".join(texts)


def test_fcfs_server_refuses_a_priority_on_both_front_ends(tiny_model_dir: pathlib.Path) -> None:
    async def body() -> None:
        async with front_end(args_with(tiny_model_dir, "fcfs")) as (ingress, http, _):
            base = {"model": MODEL, "max_tokens": 2}
            for route, extra in (
                ("/v1/completions", {"prompt": "Hi"}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
            ):
                answer = await http.post(route, json={**base, **extra, "priority": 3})
                assert answer.status_code == 400, answer.text
                error = answer.json()["error"]
                assert error["param"] == "priority"
                assert error["type"] == "invalid_request_error"
                assert "--scheduling-policy priority" in error["message"]
                ok = await http.post(route, json={**base, **extra, "priority": 0})
                assert ok.status_code == 200, ok.text
            rpc = GenerationRpc(ingress.frontend)
            with pytest.raises(GrpcAbort) as caught:
                await grpc_texts(rpc, 3)
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "--scheduling-policy priority" in caught.value.details
            assert await grpc_texts(rpc, 0)

    asyncio.run(body())


def test_priority_server_takes_a_priority_and_checks_its_type(
    tiny_model_dir: pathlib.Path,
) -> None:
    async def body() -> None:
        async with front_end(args_with(tiny_model_dir, "priority")) as (ingress, http, client):
            completion = await client.completions.create(
                model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": -7}
            )
            assert completion.choices[0].text
            chat = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=2,
                extra_body={"priority": 12},
            )
            assert chat.choices[0].message.content is not None
            for bad in ("1", 1.5, 2**31):
                answer = await http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "Hi", "priority": bad}
                )
                assert answer.status_code == 400, answer.text
                assert answer.json()["error"]["param"] == "priority"
            assert await grpc_texts(GenerationRpc(ingress.frontend), 5)

    asyncio.run(body())
