"""Peer pull on the tiny Llama (float32): a prefix pulled from another engine gives the same
greedy tokens as computing it, and every failure in flight falls back to computing."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib

from cluster.kv_transfer.cost_model import TransferCostModel
from cluster.kv_transfer.puller import PullSettings
from tests.kv_transfer.pair import (
    LONG_PROMPT,
    EnginePair,
    assert_no_pins,
    build_pair,
    final_output,
)
from workers.block_io import BlockShard


def test_pulled_prefix_gives_the_computed_greedy_tokens(tiny_model_dir: pathlib.Path) -> None:
    async def scenario() -> None:
        pair = build_pair(tiny_model_dir)
        computed = await final_output(pair.holder, pair.request(LONG_PROMPT))
        pulled = await final_output(pair.receiver, pair.request(LONG_PROMPT))
        counters = pair.services["receiver"].counters
        assert counters.pulls == 1 and counters.pulled_blocks > 0 and not counters.fallbacks
        assert pulled.num_cached_tokens == counters.pulled_blocks * 8
        assert pulled.outputs[0].token_ids == computed.outputs[0].token_ids
        assert pair.services["holder"].counters.exports == 1
        assert_no_pins(pair.holder, pair.receiver)
        await pair.shutdown()

    asyncio.run(scenario())


def _fallback_scenario(model_dir: pathlib.Path, tamper: object, **settings: object) -> None:
    """The holder computes the prompt; `tamper(pair)` breaks the pull somehow; the receiver must
    still give the holder's greedy tokens, hold no pin, and count a fallback."""

    async def scenario() -> tuple[dict[str, int], int]:
        pair = build_pair(
            model_dir, PullSettings(**{"timeout_s": 5.0, "use_cost_model": False, **settings})
        )
        request = pair.request(LONG_PROMPT)
        computed = await final_output(pair.holder, request)
        tamper(pair)  # type: ignore[operator]
        pulled = await final_output(pair.receiver, pair.request(LONG_PROMPT))
        assert pulled.outputs[0].token_ids == computed.outputs[0].token_ids
        counters = pair.services["receiver"].counters
        assert_no_pins(pair.holder, pair.receiver)
        await pair.shutdown()
        return dict(counters.fallbacks), counters.pulled_blocks

    return asyncio.run(scenario())


def _wrap_holder_read(pair: EnginePair, before_return: object) -> None:
    workers = pair.holder.core.workers
    read = workers.read_blocks_async

    async def tampered(sources: list[tuple[str, int]]) -> list[BlockShard]:
        shards = await read(sources)
        return await before_return(sources, shards)  # type: ignore[operator]

    workers.read_blocks_async = tampered  # type: ignore[method-assign]


def test_a_block_corrupted_in_flight_is_caught_and_computed(tiny_model_dir: pathlib.Path) -> None:
    def tamper(pair: EnginePair) -> None:
        async def flip(sources: object, shards: list[BlockShard]) -> list[BlockShard]:
            shards[0].rows[3, 100] ^= 0xFF  # after the holder took its checksums
            return shards

        _wrap_holder_read(pair, flip)

    fallbacks, pulled = _fallback_scenario(tiny_model_dir, tamper)
    assert fallbacks == {"checksum": 1} and pulled == 3  # the three blocks before it are good


def test_a_block_rewritten_in_flight_is_stale_and_computed(tiny_model_dir: pathlib.Path) -> None:
    def tamper(pair: EnginePair) -> None:
        pool = pair.holder.core.block_manager._device

        async def rewrite(sources: list[tuple[str, int]], shards: list[BlockShard]) -> object:
            pool.generations[sources[2][1]] += 1  # as if the block were reused while read
            return shards

        _wrap_holder_read(pair, rewrite)

    fallbacks, pulled = _fallback_scenario(tiny_model_dir, tamper)
    assert fallbacks == {"stale": 1} and pulled == 2


def test_a_block_discarded_while_pinned_is_stale_and_computed(
    tiny_model_dir: pathlib.Path,
) -> None:
    def tamper(pair: EnginePair) -> None:
        bm = pair.holder.core.block_manager

        async def discard(sources: list[tuple[str, int]], shards: list[BlockShard]) -> object:
            bm.discard([sources[1][1]], [])  # its key goes (a checksum failure elsewhere)
            return shards

        _wrap_holder_read(pair, discard)

    fallbacks, pulled = _fallback_scenario(tiny_model_dir, tamper)
    assert fallbacks == {"stale": 1} and pulled == 1


def test_blocks_evicted_before_the_pull_are_computed(tiny_model_dir: pathlib.Path) -> None:
    def tamper(pair: EnginePair) -> None:
        bm = pair.holder.core.block_manager
        held = [b for b, h in enumerate(bm._device.hashes) if h is not None]
        locator = pair.services["receiver"].puller.locator

        async def stale_directory(chain: list[bytes]) -> dict[str, int]:
            return {"holder": len(chain)}

        locator.holdings = stale_directory  # the directory has not heard of the eviction yet
        bm.discard(held, [])

    fallbacks, pulled = _fallback_scenario(tiny_model_dir, tamper)
    assert fallbacks == {"not_held": 1} and pulled == 0


def test_a_holder_dying_mid_transfer_fails_nothing(tiny_model_dir: pathlib.Path) -> None:
    def tamper(pair: EnginePair) -> None:
        async def die(sources: object, shards: object) -> object:
            raise RuntimeError("the holder's rank actor died")

        _wrap_holder_read(pair, die)

    fallbacks, pulled = _fallback_scenario(tiny_model_dir, tamper)
    assert fallbacks == {"holder_failed": 1} and pulled == 0


def test_a_holder_that_hangs_times_out_and_releases_its_pins(
    tiny_model_dir: pathlib.Path,
) -> None:
    def tamper(pair: EnginePair) -> None:
        async def hang(sources: object, shards: object) -> object:
            await asyncio.Event().wait()

        _wrap_holder_read(pair, hang)

    fallbacks, pulled = _fallback_scenario(tiny_model_dir, tamper, timeout_s=0.5)
    assert fallbacks == {"timeout": 1} and pulled == 0


def test_another_tenant_never_pulls_a_salted_prefix(tiny_model_dir: pathlib.Path) -> None:
    async def scenario() -> None:
        pair = build_pair(tiny_model_dir)
        mine = pair.request(LONG_PROMPT, tenant_salt=b"tenant-a")
        computed = await final_output(pair.holder, mine)
        theirs = dataclasses.replace(
            pair.request(LONG_PROMPT, tenant_salt=b"tenant-b"), kv_source=pair.hint_for(mine)
        )
        output = await final_output(pair.receiver, theirs)
        assert output.num_cached_tokens == 0
        assert output.outputs[0].token_ids == computed.outputs[0].token_ids
        assert pair.services["receiver"].counters.pulls == 0
        assert_no_pins(pair.holder, pair.receiver)
        await pair.shutdown()

    asyncio.run(scenario())


def test_a_hint_pulls_without_asking_the_directory(tiny_model_dir: pathlib.Path) -> None:
    async def scenario() -> None:
        pair = build_pair(tiny_model_dir, PullSettings(timeout_s=5.0))  # cost model on
        request = pair.request(LONG_PROMPT)
        computed = await final_output(pair.holder, request)
        pair.services["receiver"].puller.locator = None
        hinted = dataclasses.replace(pair.request(LONG_PROMPT), kv_source=pair.hint_for(request))
        output = await final_output(pair.receiver, hinted)
        assert output.num_cached_tokens > 0
        assert output.outputs[0].token_ids == computed.outputs[0].token_ids
        assert_no_pins(pair.holder, pair.receiver)
        await pair.shutdown()

    asyncio.run(scenario())


def test_the_cost_model_computes_when_the_copy_would_be_slower(
    tiny_model_dir: pathlib.Path,
) -> None:
    async def scenario() -> None:
        slow_link = TransferCostModel(bandwidth_prior_bytes_per_s=1.0)  # 1 B/s: never copy
        pair = build_pair(tiny_model_dir, PullSettings(timeout_s=5.0), slow_link)
        computed = await final_output(pair.holder, pair.request(LONG_PROMPT))
        output = await final_output(pair.receiver, pair.request(LONG_PROMPT))
        counters = pair.services["receiver"].counters
        assert counters.declined == 1 and counters.pulls == 0
        assert output.num_cached_tokens == 0
        assert output.outputs[0].token_ids == computed.outputs[0].token_ids
        await pair.shutdown()

    asyncio.run(scenario())


def test_blocks_demoted_to_the_holders_cpu_tier_are_pulled_from_there(
    tiny_model_dir: pathlib.Path,
) -> None:
    async def scenario() -> None:
        pair = build_pair(tiny_model_dir, num_device_blocks=48, cpu_cache=True, verify_swaps=True)
        computed = await final_output(pair.holder, pair.request(LONG_PROMPT))
        for index in range(2):  # other long prompts push the prefix out to the CPU tier
            await final_output(pair.holder, pair.request(f"{index} " + LONG_PROMPT[::-1]))
        holder_bm = pair.holder.core.block_manager
        assert holder_bm.tier_counters().demoted_blocks > 0
        tiers: list[str] = []
        read = pair.holder.core.workers.read_blocks_async

        async def recording(sources: list[tuple[str, int]]) -> list[BlockShard]:
            tiers.extend(tier for tier, _ in sources)
            return await read(sources)

        pair.holder.core.workers.read_blocks_async = recording  # type: ignore[method-assign]
        pulled = await final_output(pair.receiver, pair.request(LONG_PROMPT))
        assert "cpu" in tiers
        assert pulled.num_cached_tokens == len(tiers) * 8 > 0
        assert pulled.outputs[0].token_ids == computed.outputs[0].token_ids
        assert_no_pins(pair.holder, pair.receiver)
        await pair.shutdown()

    asyncio.run(scenario())
