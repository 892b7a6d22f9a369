"""The engine over `SlotWorkers`: every output equals the paging-free reference, under memory
pressure, preemption by recompute and by swap, chunked prefill and prefix caching."""

from __future__ import annotations

import random

import pytest

from cluster.engine.engine_core import EngineCore
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from tests.engine.conftest import SlotEngineFactory
from tests.engine.slot_workers import reference_tokens


def make_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(300, 3000) for _ in range(9)]
    prompts = []
    for i in range(count):
        length = rng.randrange(3, 40)
        body = [rng.randrange(300, 3000) for _ in range(length)]
        prompts.append(shared + body if i % 3 == 0 else body)
    return prompts


def run_all(
    engine: EngineCore, prompts: list[list[int]], params: SamplingParams
) -> list[RequestOutput]:
    ids = [
        engine.add_request(engine.request_builder.build({"prompt_token_ids": p}, params)).request_id
        for p in prompts
    ]
    finals: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 10_000, "the engine stopped making progress"
        for output in engine.step():
            assert output.error is None, output.error
            if output.finished:
                finals[output.request_id] = output
    return [finals[i] for i in ids]


def assert_all_blocks_free(engine: EngineCore) -> None:
    pressure = engine.block_manager.pressure()
    assert pressure.device.used == 0 and pressure.cpu.used == 0
    assert engine.block_manager.num_free_device_blocks() == engine.block_manager.num_device_blocks
    assert pressure.num_sequences == 0


def assert_matches_reference(
    outputs: list[RequestOutput], prompts: list[list[int]], params: SamplingParams
) -> None:
    for output, prompt in zip(outputs, prompts, strict=True):
        for completion in output.outputs:
            expected = reference_tokens(
                prompt,
                params.to_settings(output_seed(params)),
                branch_index=completion.index,
                max_tokens=params.max_tokens or 0,
            )
            assert completion.token_ids == expected, f"{output.request_id}/{completion.index}"


def output_seed(params: SamplingParams) -> int:
    assert params.seed is not None or params.temperature == 0
    return params.seed or 0


GREEDY = SamplingParams(temperature=0.0, max_tokens=24)

CASES = {
    "roomy": {"num_device_blocks": 400},
    "recompute": {"num_device_blocks": 24, "scheduler": {"preemption_mode": "recompute"}},
    "swap": {"num_device_blocks": 24, "scheduler": {"preemption_mode": "swap"}},
    "auto": {"num_device_blocks": 24, "scheduler": {"preemption_mode": "auto"}},
    "chunked": {
        "num_device_blocks": 400,
        "scheduler": {"max_num_batched_tokens": 16, "max_num_seqs": 8},
    },
    "no_prefix_cache": {"num_device_blocks": 30, "cache": {"enable_prefix_caching": False}},
    "whole_prompts": {
        "num_device_blocks": 30,
        "scheduler": {"enable_chunked_prefill": False, "max_num_batched_tokens": 256},
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_outputs_equal_reference(slot_engine: SlotEngineFactory, case: str) -> None:
    engine = slot_engine(**CASES[case])
    prompts = make_prompts(14, seed=7)
    outputs = run_all(engine, prompts, GREEDY)
    assert_matches_reference(outputs, prompts, GREEDY)
    assert_all_blocks_free(engine)
    preemptions = engine.scheduler.preemptions
    if case == "recompute":
        assert preemptions.recompute >= 3 and preemptions.swap == 0
    if case == "swap":
        assert preemptions.swap >= 3
        assert engine.block_manager.pressure().swap_in_blocks > 0
    if case == "whole_prompts":
        works = [w for p in engine.workers.plans for w in p.sequences]
        assert all(w.num_samples > 0 for w in works), "a prompt was split with chunking off"
        assert max(len(w.token_ids) for w in works) > 16
    if case == "chunked":
        step_tokens = [sum(len(w.token_ids) for w in p.sequences) for p in engine.workers.plans]
        assert max(step_tokens) == 16
        assert any(len(p.sequences) > 1 for p in engine.workers.plans)
        works = [w for p in engine.workers.plans for w in p.sequences]
        assert any(w.start_pos > 0 and len(w.token_ids) > 1 for w in works), "no split prompt"


def test_seeded_parallel_sampling_under_swaps(slot_engine: SlotEngineFactory) -> None:
    engine = slot_engine(num_device_blocks=30, scheduler={"preemption_mode": "swap"})
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=20)
    prompts = make_prompts(6, seed=3)
    outputs = run_all(engine, prompts, params)
    assert_matches_reference(outputs, prompts, params)
    assert engine.scheduler.preemptions.swap > 0
    assert_all_blocks_free(engine)


def test_second_run_hits_prefix_cache(slot_engine: SlotEngineFactory) -> None:
    engine = slot_engine(num_device_blocks=200)
    prompts = make_prompts(6, seed=5)
    first = run_all(engine, prompts, GREEDY)
    assert all(o.num_cached_tokens == 0 or o is not first[0] for o in first)
    second = run_all(engine, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    block_size = engine.block_manager.block_size
    for output, prompt in zip(second, prompts, strict=True):
        assert output.num_cached_tokens == (len(prompt) - 1) // block_size * block_size
    assert engine.metrics().prefix_cache_hit_rate > 0
    assert_all_blocks_free(engine)


def test_request_outgrowing_the_whole_pool_ends_with_length(
    slot_engine: SlotEngineFactory,
) -> None:
    engine = slot_engine(num_device_blocks=6, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = list(range(300, 310))
    request = engine.add_request(engine.request_builder.build({"prompt_token_ids": prompt}, params))
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    final = [o for o in outputs if o.request_id == request.request_id][-1]
    assert final.finished and final.error is None
    completion = final.outputs[0]
    assert completion.finish_reason == "length"
    # the pool holds 24 tokens: 10 of prompt, 14 generated (the 14th needs no slot of its own)
    assert len(completion.token_ids) == 6 * 4 - len(prompt) + 1
    expected = reference_tokens(
        prompt, params.to_settings(0), branch_index=0, max_tokens=40, ignore_eos=True
    )
    assert completion.token_ids == expected[: len(completion.token_ids)]
    assert_all_blocks_free(engine)
