"""The served path's no-Ray side (`benchmarks.front_end_server`) serves what the Serve app
serves: the ingress's HTTP routes over an in-process engine give HF's greedy tokens, streamed or
not, and the same OpenAI errors; so `benchmarks.served_overhead` compares like with like."""

from __future__ import annotations

import asyncio
import pathlib

import httpx
import openai

from benchmarks.front_end_server import local_ingress
from cluster.serving.app_args import ServeAppArgs
from cluster.serving.http_api import REPLICA_HEADER, build_http_api
from tests.serving.conftest import MODEL, GreedyOracle, engine_section

PROMPTS = ["The quick brown fox", "Once upon a time"]


def test_front_end_server_answers_hf_greedy_and_openai_errors(
    tiny_model_dir: pathlib.Path, oracle: GreedyOracle
) -> None:
    args = ServeAppArgs.model_validate(
        {"served_model_name": MODEL, "engine": engine_section(tiny_model_dir)}
    )
    expected = [oracle.text(oracle.generate(oracle.prompt_ids(p), 8)[0]) for p in PROMPTS]

    async def body() -> None:
        async with local_ingress(args) as ingress:
            transport = httpx.ASGITransport(app=build_http_api(ingress))
            http = httpx.AsyncClient(transport=transport, base_url="http://front-end")
            client = openai.AsyncOpenAI(
                api_key="none", base_url="http://front-end/v1", http_client=http
            )
            params = {"model": MODEL, "max_tokens": 8, "temperature": 0}
            extra = {"ignore_eos": True}
            whole = await asyncio.gather(
                *(client.completions.create(prompt=p, **params, extra_body=extra) for p in PROMPTS)
            )
            assert [r.choices[0].text for r in whole] == expected
            for prompt, text in zip(PROMPTS, expected, strict=True):
                stream = await client.completions.create(
                    prompt=prompt, stream=True, **params, extra_body=extra
                )
                assert "".join([c.choices[0].text async for c in stream if c.choices]) == text

            raw = await http.post("/v1/completions", json={"prompt": "x", "model": MODEL})
            assert raw.headers[REPLICA_HEADER] == "in-process"
            unknown = await http.post("/v1/completions", json={"prompt": "x", "model": "nope"})
            assert unknown.status_code == 404
            assert unknown.json()["error"]["code"] == "model_not_found"
            bad = await http.post("/v1/completions", json={"prompt": "x", "model": MODEL, "n": 0})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
            assert (await http.get("/health")).json() == {"status": "ok"}

    asyncio.run(asyncio.wait_for(body(), 120))
