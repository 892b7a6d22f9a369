"""LoRA through the real HTTP routes and gRPC methods, without Ray: the ingress's FastAPI app over
fake engine replicas that follow the real adapter registry. Every status code and error body of
the LoRA API: adapter selection, /v1/models, load/unload (disabled, 401, 403, bad bodies, bad
adapters, conflicts, unknown names), and gRPC's NOT_FOUND / INVALID_ARGUMENT alike."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import httpx
import pytest
import transformers

from block_manager import CacheIdentity
from cluster.engine.cache_keys import CacheKeyFactory, RequestKeys
from cluster.engine.generate_request import RequestBuilder
from cluster.engine.generation_defaults import ENGINE_DEFAULTS
from cluster.engine.lora_request import LoRARequest
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenization import PromptRenderer
from cluster.serving.app_args import ServeAppArgs
from cluster.serving.frontend import FrontEnd
from cluster.serving.grpc_service import GenerationRpc
from cluster.serving.grpc_validation import GrpcAbort
from cluster.serving.http_api import build_http_api
from cluster.serving.ingress import OpenAIIngress
from cluster.serving.lora_routes import BaseModelFacts
from cluster.serving.openai_serving import OpenAIServing
from cluster.serving.tenancy import Tenancy
from protos import generation_pb2 as pb
from tests.serving.lora_fakes import BASE, FakeDeployment

KEYS = {"k-user": "alice", "k-admin": {"tenant": "ops", "admin": True}}
USER = {"Authorization": "Bearer k-user"}
ADMIN = {"Authorization": "Bearer k-admin"}
NOT_FOUND_BODY = {"type": "NotFoundError", "param": "model", "code": "model_not_found"}


@pytest.fixture(scope="module")
def builder(tiny_model_dir: pathlib.Path) -> RequestBuilder:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    return RequestBuilder(PromptRenderer(tokenizer, len(tokenizer)), 4)


class Harness:
    def __init__(self, deployment: FakeDeployment, client: httpx.AsyncClient, rpc: GenerationRpc):
        self.deployment, self.client, self.rpc = deployment, client, rpc

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await self.client.post(
            path, content=content, headers=USER if headers is None else headers
        )

    async def models(self) -> list[dict[str, Any]]:
        response = await self.client.get("/v1/models", headers=USER)
        assert response.status_code == 200
        return list(response.json()["data"])


def run(
    builder: RequestBuilder,
    test: Callable[[Harness], Awaitable[None]],
    **app_args: Any,
) -> None:
    args = ServeAppArgs.model_validate(
        {"served_model_name": BASE, "api_keys": KEYS, "lora_modules": {"sql": "/a/sql"}, **app_args}
    )

    async def body() -> None:
        deployment = FakeDeployment(args.configured_adapters())
        await deployment.start()
        ingress = object.__new__(OpenAIIngress.func_or_class)  # no Ray: only what the routes use
        ingress.args = args
        ingress.tenancy = Tenancy(args.tenants_by_key(), args.admin_keys())
        ingress.adapters = deployment.adapters
        frontend = FrontEnd(
            builder, 512, deployment, deployment.adapters, generation_defaults=ENGINE_DEFAULTS
        )
        ingress.frontend = frontend
        ingress.openai = OpenAIServing(frontend, BASE)
        ingress.created = 0
        ingress.base_model = BaseModelFacts("/models/base", 512, "llama")
        rpc = GenerationRpc(frontend)
        transport = httpx.ASGITransport(app=build_http_api(ingress))
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            try:
                await test(Harness(deployment, client, rpc))
            finally:
                await deployment.stop()

    asyncio.run(asyncio.wait_for(body(), 60))


def completion(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "Hello there", "max_tokens": 4, **extra}


def test_model_selects_the_adapter_for_completions_chat_and_streams(
    builder: RequestBuilder,
) -> None:
    async def check(h: Harness) -> None:
        response = await h.post("/v1/completions", completion("sql"))
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "sql"
        assert response.json()["choices"][0]["text"] == "[sql]"
        base = await h.post("/v1/completions", completion(BASE))
        assert base.json()["choices"][0]["text"] == f"[{BASE}]"
        chat = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        streamed = await h.post("/v1/chat/completions", chat)
        events = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert events and all(json.loads(e[6:])["model"] == "sql" for e in events)
        assert "[sql]" in streamed.text and streamed.text.rstrip().endswith("[DONE]")
        adapters = [r.adapter for engine in h.deployment.engines for r in engine.requests]
        assert sorted(adapters, key=str) == sorted(["sql", None, "sql"], key=str)

    run(builder, check)


def test_models_lists_the_base_model_and_each_adapter_with_its_parent(
    builder: RequestBuilder,
) -> None:
    async def check(h: Harness) -> None:
        base, sql = await h.models()
        assert (base["id"], base["root"], base["parent"], base["object"]) == (
            BASE,
            "/models/base",
            None,
            "model",
        )
        assert (sql["id"], sql["root"], sql["parent"], sql["object"]) == (
            "sql",
            "/a/sql",
            BASE,
            "model",
        )
        # an adapter runs on the base model: its context and architecture are the base's
        for card in (base, sql):
            assert (card["max_model_len"], card["architecture"]) == (512, "llama")

    run(builder, check)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_unknown_model_is_a_404_in_openais_body(builder: RequestBuilder, path: str) -> None:
    async def check(h: Harness) -> None:
        body = completion("gpt-4") if "chat" not in path else {
            "model": "gpt-4", "messages": [{"role": "user", "content": "x"}]
        }  # fmt: skip
        response = await h.post(path, body)
        assert response.status_code == 404
        error = response.json()["error"]
        assert {k: error[k] for k in NOT_FOUND_BODY} == NOT_FOUND_BODY
        assert "gpt-4" in error["message"]

    run(builder, check)


def test_an_adapter_unloaded_before_admission_is_a_404_too(builder: RequestBuilder) -> None:
    async def check(h: Harness) -> None:
        for engine in h.deployment.engines:  # the engines lost it; the ingress's view has it
            engine.forgotten.add("sql")
        response = await h.post("/v1/completions", completion("sql"))
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"

    run(builder, check)


def test_load_and_unload_are_absent_unless_runtime_updating_is_on(builder: RequestBuilder) -> None:
    async def check(h: Harness) -> None:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            response = await h.post(path, {"lora_name": "x", "lora_path": "/a/x"}, ADMIN)
            assert response.status_code == 404
            assert "error" in response.json()
        assert [m["id"] for m in await h.models()] == [BASE, "sql"]

    run(builder, check)


def test_only_admin_keys_may_load_and_unload(builder: RequestBuilder) -> None:
    async def check(h: Harness) -> None:
        body = {"lora_name": "chat", "lora_path": "/a/chat"}
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            missing = await h.post(path, body, {})
            assert missing.status_code == 401
            assert missing.json()["error"]["type"] == "authentication_error"
            user = await h.post(path, body, USER)
            assert user.status_code == 403
            assert user.json()["error"]["type"] == "permission_error"
        assert [m["id"] for m in await h.models()] == [BASE, "sql"]

    run(builder, check, allow_runtime_lora_updating=True)


def test_load_use_and_unload_an_adapter_at_run_time(builder: RequestBuilder) -> None:
    async def check(h: Harness) -> None:
        body = {"lora_name": "chat", "lora_path": "/a/chat"}
        loaded = await h.post("/v1/load_lora_adapter", body, ADMIN)
        assert (loaded.status_code, loaded.text) == (
            200,
            "Success: LoRA adapter 'chat' added successfully.",
        )
        assert h.deployment.served() == [{"sql", "chat"}] * 2
        assert (await h.post("/v1/load_lora_adapter", body, ADMIN)).status_code == 200
        assert [m["id"] for m in await h.models()] == [BASE, "sql", "chat"]
        used = await h.post("/v1/completions", completion("chat"))
        assert used.json()["choices"][0]["text"] == "[chat]"
        unloaded = await h.post("/v1/unload_lora_adapter", {"lora_name": "chat"}, ADMIN)
        assert (unloaded.status_code, unloaded.text) == (
            200,
            "Success: LoRA adapter 'chat' removed successfully.",
        )
        assert h.deployment.served() == [{"sql"}] * 2
        assert (await h.post("/v1/completions", completion("chat"))).status_code == 404
        again = await h.post("/v1/unload_lora_adapter", {"lora_name": "chat"}, ADMIN)
        assert again.status_code == 404
        assert again.json()["error"]["type"] == "NotFoundError"

    run(builder, check, allow_runtime_lora_updating=True)


LOAD = "/v1/load_lora_adapter"


def load_body(name: Any, path: str) -> dict[str, Any]:
    return {"lora_name": name, "lora_path": path}


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        (LOAD, {"lora_name": "x"}, "lora_path", "Field required"),
        (LOAD, {"lora_path": "/a/x"}, "lora_name", "Field required"),
        (LOAD, load_body("a b", "/a/x"), "lora_name", ""),
        (LOAD, load_body(3, "/a/x"), "lora_name", ""),
        (LOAD, b"{not json", None, "not valid JSON"),
        (LOAD, load_body(BASE, "/a/x"), "lora_name", "base"),
        (LOAD, load_body("sql", "/a/x"), "lora_path", "already"),
        (LOAD, load_body("m", "/a/malformed"), "lora_path", "not valid JSON"),
        (LOAD, load_body("r", "/a/rank128"), "lora_path", "max_lora_rank"),
        (LOAD, load_body("w", "/a/wrong-shape"), "lora_path", "shape"),
        (LOAD, load_body("n", "/a/missing"), "lora_path", "adapter_config"),
        ("/v1/unload_lora_adapter", {}, "lora_name", "Field required"),
    ],
)
def test_bad_load_and_unload_input_is_a_400_and_changes_nothing(
    builder: RequestBuilder, path: str, body: Any, param: str | None, fragment: str
) -> None:
    async def check(h: Harness) -> None:
        response = await h.post(path, body, ADMIN)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
        assert fragment in error["message"]
        assert [m["id"] for m in await h.models()] == [BASE, "sql"]
        assert h.deployment.served() == [{"sql"}] * 2
        assert (await h.post("/v1/completions", completion("sql"))).status_code == 200

    run(builder, check, allow_runtime_lora_updating=True)


def test_without_api_keys_anyone_may_load_when_it_is_on(builder: RequestBuilder) -> None:
    async def check(h: Harness) -> None:
        body = {"lora_name": "chat", "lora_path": "/a/chat"}
        assert (await h.post("/v1/load_lora_adapter", body, {})).status_code == 200

    run(builder, check, allow_runtime_lora_updating=True, api_keys={})


async def grpc_generate(rpc: GenerationRpc, request: pb.GenerateRequest) -> str:
    texts = []
    async for response in rpc.generate(request, request_id="g", tenant_salt=None):
        texts.extend(choice.text for choice in response.choices)
    return "".join(texts)


def test_grpc_selects_adapters_and_refuses_like_http(builder: RequestBuilder) -> None:
    async def check(h: Harness) -> None:
        sampling = pb.SamplingParameters(max_tokens=4)
        assert await grpc_generate(h.rpc, pb.GenerateRequest(text="x", adapter="sql")) == "[sql]"
        by_model = pb.GenerateRequest(model="sql", text="x", sampling=sampling)
        assert await grpc_generate(h.rpc, by_model) == "[sql]"
        both = pb.GenerateRequest(model=BASE, adapter="sql", text="x")
        assert await grpc_generate(h.rpc, both) == "[sql]"
        assert await grpc_generate(h.rpc, pb.GenerateRequest(text="x")) == f"[{BASE}]"
        refused = [
            (pb.GenerateRequest(text="x", adapter="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
            (pb.GenerateRequest(model="gpt-4", text="x"), grpc.StatusCode.NOT_FOUND, "gpt-4"),
            (
                pb.GenerateRequest(model="other", adapter="sql", text="x"),
                grpc.StatusCode.INVALID_ARGUMENT,
                "different models",
            ),
        ]
        for request, code, fragment in refused:
            with pytest.raises(GrpcAbort) as caught:
                await grpc_generate(h.rpc, request)
            assert caught.value.code == code and fragment in caught.value.details
            http = await h.post("/v1/completions", completion(request.adapter or request.model))
            expected = 404 if code == grpc.StatusCode.NOT_FOUND else 200
            assert http.status_code == expected  # HTTP has one field: same name, same answer
        h.rpc.check_model("sql")  # Tokenize and friends accept an adapter's name
        with pytest.raises(GrpcAbort) as caught:
            h.rpc.check_model("gpt-4")
        assert caught.value.code == grpc.StatusCode.NOT_FOUND

    run(builder, check)


def test_a_grpc_request_for_an_adapter_unloaded_before_admission_is_not_found(
    builder: RequestBuilder,
) -> None:
    async def check(h: Harness) -> None:
        await h.deployment.remove_lora("sql")
        h.deployment.adapters.view = await h.deployment.registry.snapshot()
        with pytest.raises(GrpcAbort) as caught:
            await grpc_generate(h.rpc, pb.GenerateRequest(text="x", adapter="sql"))
        assert caught.value.code == grpc.StatusCode.NOT_FOUND
        assert await h.deployment.list_loras() == []
        await h.deployment.add_lora(LoRARequest("sql", 1, "/a/sql", BASE))
        assert await grpc_generate(h.rpc, pb.GenerateRequest(text="x", adapter="sql")) == "[sql]"

    run(builder, check)


def test_adapter_requests_are_hashed_exactly_as_the_engines_key_them(
    builder: RequestBuilder,
) -> None:
    async def check(h: Harness) -> None:
        identity = CacheIdentity(model_weights_digest="w", tokenizer_digest="t", block_size=4)
        ingress_keys = RequestKeys(CacheKeyFactory(identity), 4)
        engine_keys = RequestKeys(CacheKeyFactory(identity), 4)
        engine_keys.adapters = h.deployment.engines[0].digests()
        await h.deployment.adapters.list_loras()  # the ingress's view, as its watch keeps it
        frontend = FrontEnd(
            builder,
            512,
            h.deployment,
            h.deployment.adapters,
            ingress_keys,
            generation_defaults=ENGINE_DEFAULTS,
        )
        prompt = "the same prompt, long enough to fill several blocks of four tokens"

        def request(adapter: str | None) -> Any:
            return builder.build(prompt, SamplingParams(), adapter=adapter)

        sql = frontend.routing_hashes(request("sql"))
        assert sql and sql == engine_keys.block_hashes(request("sql"))
        assert not set(sql) & set(frontend.routing_hashes(request(None)))
        prepared = frontend.prepare(
            prompt, SamplingParams(), request_id="once", tenant_salt=None, adapter="sql"
        )
        assert list(prepared.block_hashes) == sql  # hashed when prepared, carried on it
        h.deployment.adapters.view = dataclasses.replace(h.deployment.adapters.view, digests={})
        assert frontend.routing_hashes(request("sql")) == []  # no agreed digest: load only

    run(builder, check)
