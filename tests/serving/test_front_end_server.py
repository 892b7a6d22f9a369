"""The served path's no-Ray side (`benchmarks.front_end_server`) serves what the Serve app
serves: the ingress's HTTP routes over an in-process engine give HF's greedy tokens, streamed or
not, and the same OpenAI errors; so `benchmarks.served_overhead` compares like with like. The
penalty fields reach the engine as the offline `LLM` takes them."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import torch
import transformers

from benchmarks.front_end_server import local_ingress
from cluster.engine.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.app_args import ServeAppArgs
from cluster.serving.http_api import REPLICA_HEADER, build_http_api
from tests.serving.conftest import MODEL, GreedyOracle, engine_section

PROMPTS = ["The quick brown fox", "Once upon a time"]


def tiny_args(model_dir: pathlib.Path) -> ServeAppArgs:
    return ServeAppArgs.model_validate(
        {"served_model_name": MODEL, "engine": engine_section(model_dir)}
    )


@contextlib.asynccontextmanager
async def front_end(
    args: ServeAppArgs,
) -> AsyncIterator[tuple[Any, httpx.AsyncClient, openai.AsyncOpenAI]]:
    """The no-Ray ingress over an in-process engine, with a raw HTTP client and OpenAI's."""
    async with local_ingress(args) as ingress:
        transport = httpx.ASGITransport(app=build_http_api(ingress))
        http = httpx.AsyncClient(transport=transport, base_url="http://front-end")
        client = openai.AsyncOpenAI(
            api_key="none", base_url="http://front-end/v1", http_client=http
        )
        yield ingress, http, client


def test_front_end_server_answers_hf_greedy_and_openai_errors(
    tiny_model_dir: pathlib.Path, oracle: GreedyOracle
) -> None:
    args = tiny_args(tiny_model_dir)
    expected = [oracle.text(oracle.generate(oracle.prompt_ids(p), 8)[0]) for p in PROMPTS]

    async def body() -> None:
        async with front_end(args) as (_, http, client):
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


REPEATING_PROMPT = "out out out out out out out out"
"""The tiny model's greedy answer repeats one token here, so a frequency penalty changes it."""


def test_penalties_over_http_decode_as_the_offline_llm_does(tiny_model_dir: pathlib.Path) -> None:
    args = tiny_args(tiny_model_dir)
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    offline_params = {
        "plain": SamplingParams(**greedy),
        "frequency": SamplingParams(**greedy, frequency_penalty=1.5),
        "bias": SamplingParams(**greedy, logit_bias={7395: 100.0}),
        "allowed": SamplingParams(**greedy, allowed_token_ids=[7395, 11]),
        "bad_words": SamplingParams(**greedy, bad_words=["dinner"]),
    }
    with LLM(config=args.engine_config()) as llm:
        offline = {
            name: llm.generate([REPEATING_PROMPT], params, use_tqdm=False)[0].outputs[0]
            for name, params in offline_params.items()
        }
    assert offline["frequency"].token_ids != offline["plain"].token_ids
    assert offline["bias"].token_ids == [7395] * 12
    assert set(offline["allowed"].token_ids) <= {7395, 11}
    assert offline["bad_words"].token_ids != offline["plain"].token_ids

    async def body() -> None:
        async with front_end(args) as (ingress, http, client):
            params = {"model": MODEL, "prompt": REPEATING_PROMPT, "max_tokens": 12}
            params["temperature"] = 0
            extra = {"ignore_eos": True}
            plain, frequency, bias = await asyncio.gather(
                client.completions.create(**params, extra_body=extra),
                client.completions.create(**params, frequency_penalty=1.5, extra_body=extra),
                client.completions.create(**params, logit_bias={"7395": 100}, extra_body=extra),
            )
            assert plain.choices[0].text == offline["plain"].text
            assert frequency.choices[0].text == offline["frequency"].text
            assert frequency.choices[0].text != plain.choices[0].text
            assert bias.choices[0].text == offline["bias"].text
            allowed, bad_words = await asyncio.gather(
                client.completions.create(
                    **params, extra_body={**extra, "allowed_token_ids": [7395, 11]}
                ),
                client.completions.create(**params, extra_body={**extra, "bad_words": ["dinner"]}),
            )
            assert allowed.choices[0].text == offline["allowed"].text
            assert bad_words.choices[0].text == offline["bad_words"].text

            vocab_size = ingress.engine.model_info().vocab_size
            outside = await http.post(
                "/v1/completions",
                json={**params, "logit_bias": {str(vocab_size): 1.0}},
            )
            assert outside.status_code == 400
            assert "logit_bias" in outside.json()["error"]["message"]
            for body in (
                {"allowed_token_ids": [1, vocab_size]},
                {"allowed_token_ids": []},
                {"bad_words": [""]},
            ):
                refused = await http.post("/v1/completions", json={**params, **body})
                assert refused.status_code == 400, body
                assert next(iter(body)) in refused.json()["error"]["message"]
            cut = await client.completions.create(
                **params, extra_body={**extra, "truncate_prompt_tokens": 3}
            )
            assert cut.usage.prompt_tokens == 3

    asyncio.run(asyncio.wait_for(body(), 120))


def test_echo_with_logprobs_scores_the_prompt_as_hf_does(
    tiny_model_dir: pathlib.Path, tiny_hf: transformers.PreTrainedModel
) -> None:
    """What an evaluation harness sends to score a continuation: token ids, `echo`,
    `logprobs: 1`, `max_tokens: 1`; each prompt token's logprob must be HF's."""
    args = tiny_args(tiny_model_dir)
    hf = tiny_hf
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt_ids = tokenizer.encode("Paged attention keeps the cache in blocks of tokens")
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids])).logits[0].to(torch.float32)
    reference = torch.log_softmax(logits, dim=-1)

    async def body() -> None:
        async with front_end(args) as (_, http, client):
            common = {"model": MODEL, "max_tokens": 1, "temperature": 0, "echo": True}
            scored, plain, text = await asyncio.gather(
                client.completions.create(prompt=prompt_ids, logprobs=1, **common),
                client.completions.create(prompt=prompt_ids, **common),
                client.completions.create(prompt="Once upon a time", logprobs=0, **common),
            )
            choice = scored.choices[0]
            logprobs = choice.logprobs
            assert logprobs is not None and logprobs.token_logprobs is not None
            assert len(logprobs.token_logprobs) == len(prompt_ids) + 1
            assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
            for i in range(1, len(prompt_ids)):
                expected = float(reference[i - 1, prompt_ids[i]])
                assert abs(logprobs.token_logprobs[i] - expected) < 1e-4, i
                (best,) = logprobs.top_logprobs[i].values()
                assert abs(best - float(reference[i - 1].max())) < 1e-4
            generated = int(reference[-1].argmax())
            assert abs(logprobs.token_logprobs[-1] - float(reference[-1, generated])) < 1e-4
            assert len(logprobs.tokens) == len(prompt_ids) + 1
            decoded = tokenizer.decode(prompt_ids)
            assert choice.text.startswith(decoded) and plain.choices[0].text == choice.text
            assert plain.choices[0].logprobs is None
            assert text.choices[0].text.startswith("Once upon a time")
            assert (
                len(text.choices[0].logprobs.tokens)
                == len(tokenizer.encode("Once upon a time")) + 1
            )

            streamed = await http.post(
                "/v1/completions", json={**common, "prompt": "x", "stream": True}
            )
            assert streamed.status_code == 400 and "echo" in streamed.json()["error"]["message"]

            # vLLM's field: token id -> logprob, rank and text, on completions and chat
            body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
            completion, chat = await asyncio.gather(
                http.post("/v1/completions", json={**body, "prompt": prompt_ids}),
                http.post(
                    "/v1/chat/completions",
                    json={**body, "messages": [{"role": "user", "content": "Hi there"}]},
                ),
            )
            shown = completion.json()["choices"][0]["prompt_logprobs"]
            chat_shown = chat.json()["prompt_logprobs"]
            assert shown[0] is None and chat_shown[0] is None
            assert len(shown) == len(prompt_ids) and len(chat_shown) > 3
            for i in range(1, len(prompt_ids)):
                own = shown[i][str(prompt_ids[i])]
                assert abs(own["logprob"] - float(reference[i - 1, prompt_ids[i]])) < 1e-4
                ranked = sorted(v["rank"] for v in shown[i].values() if "rank" in v)
                assert ranked == [1, 2] and len(shown[i]) <= 3
                top_two = torch.topk(reference[i - 1], 2).indices.tolist()
                by_rank = sorted((v["rank"], int(t)) for t, v in shown[i].items() if "rank" in v)
                assert [token for _, token in by_rank] == top_two
            assert (
                "prompt_logprobs"
                not in (
                    await http.post(
                        "/v1/completions", json={**body, "prompt": "x", "prompt_logprobs": None}
                    )
                ).json()["choices"][0]
            )
            refused = await http.post(
                "/v1/completions", json={**body, "prompt": "x", "stream": True}
            )
            assert refused.status_code == 400
            assert "prompt_logprobs" in refused.json()["error"]["message"]

    asyncio.run(asyncio.wait_for(body(), 120))
