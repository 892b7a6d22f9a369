"""Load generation over the OpenAI HTTP API, shared by the serving benchmarks: a job, what one
streamed completion measured (`one_request`), and a Poisson arrival of jobs (`run_workload`)."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm


@dataclass(frozen=True)
class Job:
    prompt: str | list[int] | list[dict[str, str]]
    """Text or token ids (token ids skip the server's tokenizer: the same tokens on any
    server), sent to /v1/completions; or chat messages, sent to /v1/chat/completions."""
    max_tokens: int

    @property
    def is_chat(self) -> bool:
        return bool(self.prompt) and isinstance(self.prompt[0], dict)


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    served_by: str = ""
    gaps: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def one_request(client: httpx.AsyncClient, model: str, job: Job) -> Result:
    body = {
        "model": model,
        ("messages" if job.is_chat else "prompt"): job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result = Result(ok=False)
    last = None
    try:
        path = "/v1/chat/completions" if job.is_chat else "/v1/completions"
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            result.served_by = response.headers.get("x-pagedserve-replica", "")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                now = time.perf_counter()
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.gaps.append(now - last)
                    last = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens", 0)
    except httpx.HTTPError as error:
        result.error = repr(error)
        return result
    result.latency = time.perf_counter() - start
    result.ok = last is not None
    return result


async def run_workload(
    base_url: str, model: str, api_key: str, jobs: list[Job], rate: float, seed: int, label: str
) -> tuple[list[Result], float]:
    """Sends `jobs` with exponential inter-arrival gaps (Poisson at `rate` per second)."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"}
    limits = httpx.Limits(max_connections=len(jobs))
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=600, limits=limits
    ) as client:
        progress = tqdm(total=len(jobs), desc=label, file=sys.stderr, leave=False)
        tasks = []
        start = time.perf_counter()
        for job in jobs:
            task = asyncio.create_task(one_request(client, model, job))
            task.add_done_callback(lambda _: progress.update())
            tasks.append(task)
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        progress.close()
    return list(results), time.perf_counter() - start
