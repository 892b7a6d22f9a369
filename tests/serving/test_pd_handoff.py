"""Prefill/decode hand-off in process: a `DisaggregatedClient` over two `AsyncEngine`s on the
tiny float32 Llama gives what one colocated engine gives (the oracle), token for token, text,
log-probabilities, usage and finish reasons; cancellation and a dead engine leave no block used
on either side."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import random
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.errors import EngineDead, RequestRejected
from cluster.engine.generate_request import GenerateRequest
from cluster.engine.output_stream import OutputAccumulator, RequestDelta
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import StructuredOutputsParams
from cluster.serving.frontend import StreamTally
from cluster.serving.pd_client import DisaggregatedClient
from tests.engine.tiny_engine import PROMPTS, tiny_config
from tests.kv_transfer.pair import assert_no_pins, build_pair

SEED_RNG = 1234


async def fold(stream: AsyncIterator[RequestDelta]) -> tuple[RequestOutput, StreamTally, int]:
    """The final output, the usage tally and how many deltas came."""
    accumulator, tally, count = OutputAccumulator(), StreamTally(), 0
    output = None
    async for delta in stream:
        tally.add(delta)
        output = accumulator.apply(delta)
        count += 1
    assert output is not None and output.finished
    return output, tally, count


class ServedBy:
    """The prefill engine as the ingress sees it through Serve: requests carry their chain
    (the ingress hashes each prompt once) and deltas name the replica (`served_by`)."""

    def __init__(self, engine: AsyncEngine, name: str) -> None:
        self.engine = engine
        self.name = name

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestDelta, None]:
        stream = self.engine.generate(request)
        try:
            async for delta in stream:
                delta.served_by = self.name
                yield delta
        finally:
            await stream.aclose()


class Cluster:
    """A colocated engine (the oracle) and a prefill/decode pair joined by an in-process KV
    transport, all on the same weights."""

    def __init__(self, model_dir: pathlib.Path) -> None:
        self.pair = build_pair(model_dir, num_device_blocks=200)
        self.colocated = AsyncEngine(tiny_config(model_dir))
        self.prefill = self.pair.holder
        self.decode = self.pair.receiver

    def client(self, **kwargs: Any) -> DisaggregatedClient:
        return DisaggregatedClient(ServedBy(self.prefill, "holder"), self.decode, **kwargs)

    def build(self, prompt: str, params: SamplingParams, rid: str) -> GenerateRequest:
        request = self.colocated.request_builder.build(prompt, params, request_id=rid)
        chain = self.prefill.core.request_keys.block_hashes(request)
        return dataclasses.replace(request, block_hashes=tuple(chain))

    @property
    def pulled_blocks(self) -> int:
        return self.pair.services["receiver"].counters.pulled_blocks

    async def assert_no_blocks_used(self) -> None:
        """Every engine's device pool is back to no block used and no transfer pin is left
        (an abort lands after the step in flight: waits for that, up to a few seconds)."""
        engines = (self.colocated, self.prefill, self.decode)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while loop.time() < deadline and any(e.metrics().pressure.device.used for e in engines):
            await asyncio.sleep(0.01)
        for engine in engines:
            metrics = engine.metrics()
            assert metrics.pressure.device.used == 0 and metrics.num_running == 0
        assert_no_pins(*engines)

    async def close(self) -> None:
        await self.colocated.shutdown()
        await self.pair.shutdown()


def run(model_dir: pathlib.Path, scenario: Any) -> None:
    async def main() -> None:
        cluster = Cluster(model_dir)
        try:
            await scenario(cluster)
        finally:
            await cluster.close()

    asyncio.run(main())


async def compare(cluster: Cluster, request: GenerateRequest, **client: Any) -> RequestOutput:
    """Asserts the PD answer equals the colocated one; returns it."""
    expected, expected_tally, _ = await fold(cluster.colocated.generate(request))
    got, tally, count = await fold(cluster.client(**client).generate(request))
    want, have = expected.outputs[0], got.outputs[0]
    assert have.token_ids == want.token_ids
    assert have.text == want.text
    assert (have.finish_reason, have.stop_reason) == (want.finish_reason, want.stop_reason)
    assert have.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)
    assert got.prompt_token_ids == expected.prompt_token_ids
    assert (tally.prompt_tokens, tally.completion_tokens) == (
        expected_tally.prompt_tokens,
        expected_tally.completion_tokens,
    )
    assert tally.completion_tokens == len(want.token_ids)
    if len(want.token_ids) > 1:
        assert count >= 2 and got.metrics.first_token_time is not None
    return got


def test_greedy_seeded_logprobs_and_stops_match_colocated(tiny_model_dir: pathlib.Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
        for i, prompt in enumerate(PROMPTS[:4]):
            before = cluster.pulled_blocks
            request = cluster.build(prompt, greedy, f"greedy-{i}")
            await compare(cluster, request)
            # the decode side pulled the prompt's full blocks but the last token's
            pullable = (request.num_prompt_tokens - 1) // 8
            assert cluster.pulled_blocks - before == pullable
        # a tenant's request: both sides key its blocks under its salt, and the pull finds them
        salted = dataclasses.replace(
            cluster.build(PROMPTS[3], greedy, "tenant"), tenant_salt=b"tenant-alice"
        )
        salted = dataclasses.replace(
            salted, block_hashes=tuple(cluster.prefill.core.request_keys.block_hashes(salted))
        )
        assert salted.block_hashes != cluster.build(PROMPTS[3], greedy, "x").block_hashes
        before = cluster.pulled_blocks
        await compare(cluster, salted)
        assert cluster.pulled_blocks - before == (salted.num_prompt_tokens - 1) // 8
        # without a hint the decode side finds the blocks through its locator alone
        await compare(cluster, cluster.build(PROMPTS[5], greedy, "no-hint"), pull=False)
        seeded = SamplingParams(temperature=0.9, top_k=40, max_tokens=10, seed=7, ignore_eos=True)
        await compare(cluster, cluster.build(PROMPTS[1], seeded, "seeded"))
        # unseeded: the client draws one seed for both engines; colocated with that seed agrees
        unseeded = dataclasses.replace(seeded, seed=None)
        drawn = random.Random(SEED_RNG).randrange(2**63)
        request = cluster.build(PROMPTS[2], unseeded, "unseeded")
        oracle = dataclasses.replace(request, params=dataclasses.replace(unseeded, seed=drawn))
        expected, _, _ = await fold(cluster.colocated.generate(oracle))
        got, _, _ = await fold(cluster.client(rng=random.Random(SEED_RNG)).generate(request))
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        # a stop string straddling the first token: the held-back text must not leak
        plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        first, _, _ = await fold(cluster.colocated.generate(cluster.build(PROMPTS[0], plain, "s")))
        stop = first.outputs[0].text[: max(2, len(first.outputs[0].text) // 3)]
        stopped = dataclasses.replace(plain, stop=[stop])
        got = await compare(cluster, cluster.build(PROMPTS[0], stopped, "stop"))
        assert got.outputs[0].finish_reason == "stop"
        # one token wanted, or n > 1: no hand-off, same answer
        await compare(
            cluster, cluster.build(PROMPTS[3], dataclasses.replace(plain, max_tokens=1), "one")
        )
        two = dataclasses.replace(plain, n=2, max_tokens=5)
        expected, _, _ = await fold(cluster.colocated.generate(cluster.build(PROMPTS[4], two, "n")))
        got, _, _ = await fold(cluster.client().generate(cluster.build(PROMPTS[4], two, "n2")))
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in expected.outputs]
        await cluster.assert_no_blocks_used()

    run(tiny_model_dir, scenario)


def test_structured_output_continues_the_grammar(tiny_model_dir: pathlib.Path) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)

    async def scenario(cluster: Cluster) -> None:
        for temperature, seed in ((0.0, None), (1.0, 3)):
            params = SamplingParams(
                temperature=temperature, seed=seed, max_tokens=40, structured_outputs=constraint
            )
            got = await compare(cluster, cluster.build(PROMPTS[1], params, f"json-{seed}"))
            if got.outputs[0].finish_reason == "stop":
                document = json.loads(got.outputs[0].text)
                assert set(document) == {"name", "age"}
        await cluster.assert_no_blocks_used()

    run(tiny_model_dir, scenario)


def test_resume_refuses_what_cannot_continue(tiny_model_dir: pathlib.Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[5])
        request = cluster.build(PROMPTS[0], params, "bad")
        from workers.plan import SampledToken

        for resume in ((SampledToken(5),), tuple(SampledToken(7) for _ in range(4))):
            with pytest.raises(RequestRejected):
                await anext(cluster.decode.generate(dataclasses.replace(request, resume=resume)))
        await cluster.assert_no_blocks_used()

    run(tiny_model_dir, scenario)


def test_cancel_mid_decode_frees_both_sides(tiny_model_dir: pathlib.Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = cluster.client().generate(cluster.build(PROMPTS[3], params, "cancel"))
        for _ in range(3):
            await anext(stream)
        assert cluster.decode.metrics().pressure.device.used > 0
        await stream.aclose()
        await cluster.assert_no_blocks_used()

    run(tiny_model_dir, scenario)


class Dying:
    """An engine client whose replica dies on its first call: before any delta (`after`
    None) or after `after` deltas (the call ends with EngineDead, the engine's request with
    it, as when the replica's actor is gone)."""

    def __init__(self, engine: AsyncEngine, after: int | None = None) -> None:
        self.engine = engine
        self.after = after
        self.calls = 0

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestDelta, None]:
        self.calls += 1
        if self.calls == 1 and self.after is None:
            raise EngineDead("the replica died")
        stream = self.engine.generate(request)
        try:
            count = 0
            async for delta in stream:
                if self.calls == 1 and count == self.after:
                    raise EngineDead("the replica died mid-stream")
                count += 1
                yield delta
        finally:
            await stream.aclose()


def test_a_dead_replica_retries_or_ends_with_an_error(tiny_model_dir: pathlib.Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        request = cluster.build(PROMPTS[1], params, "retry")
        expected, _, _ = await fold(cluster.colocated.generate(request))
        for side in ("prefill", "decode"):
            flaky = Dying(getattr(cluster, side))
            engines = {"prefill": cluster.prefill, "decode": cluster.decode, side: flaky}
            client = DisaggregatedClient(engines["prefill"], engines["decode"])
            got, _, _ = await fold(client.generate(request))
            assert got.outputs[0].token_ids == expected.outputs[0].token_ids
            assert flaky.calls == 2
        # the decode replica dies mid-stream: the stream ends with EngineDead, nothing is held
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        client = DisaggregatedClient(
            ServedBy(cluster.prefill, "holder"), Dying(cluster.decode, after=2)
        )
        stream = client.generate(cluster.build(PROMPTS[3], long, "dies"))
        seen = 0
        with pytest.raises(EngineDead):
            async for _ in stream:
                seen += 1
        assert seen == 3  # the first token from the prefill side, two from the decode side
        await cluster.assert_no_blocks_used()

    run(tiny_model_dir, scenario)


def test_a_lora_request_hands_off_under_its_adapter(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    import transformers

    from cluster.engine.lora_request import LoRARequest
    from tests.lora.adapters import ALL_PROJECTIONS, build_adapter

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    build_adapter(base, tmp_path / "sql", rank=8, targets=ALL_PROJECTIONS, seed=1)
    lora = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}

    async def scenario() -> None:
        engines = [AsyncEngine(tiny_config(tiny_model_dir, lora=lora)) for _ in range(3)]
        colocated, prefill, decode = engines
        try:
            for engine in engines:
                await engine.add_lora(LoRARequest("sql", 1, str(tmp_path / "sql")))
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            answers = {}
            for adapter in ("sql", None):
                request = colocated.request_builder.build(PROMPTS[1], params, adapter=adapter)
                expected, _, _ = await fold(colocated.generate(request))
                got, _, _ = await fold(DisaggregatedClient(prefill, decode).generate(request))
                assert got.outputs[0].token_ids == expected.outputs[0].token_ids
                answers[adapter] = expected.outputs[0].token_ids
            assert answers["sql"] != answers[None]  # the adapter shapes the answer
            for engine in engines:
                assert engine.metrics().pressure.device.used == 0
        finally:
            for engine in engines:
                await engine.shutdown()

    asyncio.run(scenario())
