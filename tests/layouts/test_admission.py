"""Each layout's notion of "full": contiguous refuses or queues a request whose max-length
reservation does not fit although its actual tokens would; paged admits it."""

from __future__ import annotations

import pytest

from block_manager import CacheKey, KVCacheManager, NeverFits, NoFreeBlocks
from cluster.engine.sampling_params import SamplingParams
from kv_layouts.contiguous import ContiguousKVManager
from tests.engine.slot_workers import reference_tokens
from tests.layouts.bounds import DictBounds
from tests.layouts.conftest import SlotLayoutEngine

SEED = b"\x00" * 32


def test_contiguous_queues_what_paged_admits() -> None:
    """Two requests whose 64-token reservations fill the pool: a third 4-token prompt does not
    fit contiguous (its reservation would not), while paged, holding only their actual tokens,
    admits it."""
    bounds = DictBounds()
    contiguous = ContiguousKVManager(
        num_device_blocks=32, block_size=4, max_model_len=128, bounds=bounds
    )
    paged = KVCacheManager(num_device_blocks=32, num_cpu_blocks=0, block_size=4)
    for seq_id in (1, 2):
        bounds[seq_id] = 64
        contiguous.allocate(seq_id, list(range(8)), CacheKey(SEED))
        paged.allocate(seq_id, [seq_id * 100 + t for t in range(8)], CacheKey(SEED))
    bounds[3] = 64
    assert contiguous.pressure().device.free == 0
    assert not contiguous.can_allocate([7, 7, 7, 7], CacheKey(SEED))
    with pytest.raises(NoFreeBlocks):
        contiguous.allocate(3, [7, 7, 7, 7], CacheKey(SEED))
    assert not contiguous.has_sequence(3)
    assert paged.can_allocate([7, 7, 7, 7], CacheKey(SEED))
    paged.allocate(3, [7, 7, 7, 7], CacheKey(SEED))
    assert paged.pressure().device.used == 5


def test_contiguous_external_fragmentation() -> None:
    """20 blocks free in two runs of 10: a 12-block reservation waits, paged takes 12 blocks."""
    bounds = DictBounds()
    contiguous = ContiguousKVManager(
        num_device_blocks=30, block_size=4, max_model_len=128, bounds=bounds
    )
    for seq_id in (1, 2, 3):
        bounds[seq_id] = 40
        contiguous.allocate(seq_id, [1, 2], CacheKey(SEED))
    contiguous.free(1)
    contiguous.free(3)
    assert contiguous.free_runs() == [(0, 10), (20, 10)]
    bounds[4] = 48
    with pytest.raises(NoFreeBlocks, match="external fragmentation"):
        contiguous.allocate(4, [1, 2], CacheKey(SEED))
    contiguous.free(2)
    assert contiguous.free_runs() == [(0, 30)]
    contiguous.allocate(4, [1, 2], CacheKey(SEED))
    assert contiguous.block_table(4) == [0]
    contiguous.check_integrity()
    paged = KVCacheManager(num_device_blocks=30, num_cpu_blocks=0, block_size=4)
    paged.allocate(9, list(range(48)), CacheKey(SEED))
    assert paged.pressure().device.used == 12


def test_contiguous_rejects_a_reservation_larger_than_the_pool() -> None:
    bounds = DictBounds()
    contiguous = ContiguousKVManager(
        num_device_blocks=16, block_size=4, max_model_len=512, bounds=bounds
    )
    bounds[1] = 100  # 25 blocks reserved for 8 tokens that fit in 2
    with pytest.raises(NeverFits):
        contiguous.allocate(1, list(range(8)), CacheKey(SEED))
    paged = KVCacheManager(num_device_blocks=16, num_cpu_blocks=0, block_size=4)
    assert paged.can_allocate(list(range(8)), CacheKey(SEED))


@pytest.mark.parametrize("layout", ["paged", "contiguous", "virtual"])
def test_engine_admission_and_outputs(layout: str, slot_layout_engine: SlotLayoutEngine) -> None:
    """Two requests reserving 17 blocks each in a 32-block budget: contiguous runs one and
    queues the other, paged and virtual run both at once (and preempt when their actual tokens
    outgrow the budget); all reproduce the unpaged oracle."""
    engine = slot_layout_engine(layout, num_device_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompts = [[300 + i for i in range(8)], [900 + i for i in range(8)]]
    requests = [
        engine.add_request(engine.request_builder.build({"prompt_token_ids": p}, params))
        for p in prompts
    ]
    engine.step()
    running = len(engine.scheduler.running)
    assert running == (1 if layout == "contiguous" else 2)
    if layout == "contiguous":  # its request's prompt + max_tokens, not the model's context
        first, end = engine.block_manager.range_of(requests[0].branches[0].seq_id)
        assert end - first == -(-(8 + 60) // 4) == 17
    assert len(engine.scheduler.waiting) == 2 - running
    while engine.has_unfinished():
        engine.step()
    for prompt, request in zip(prompts, requests, strict=True):
        expected = reference_tokens(
            prompt, request.settings, branch_index=0, max_tokens=60, ignore_eos=True
        )
        assert request.branches[0].output_token_ids == expected
    assert engine.block_manager.pressure().device.used == 0


def test_non_paged_layouts_refuse_parallel_sampling(slot_layout_engine: SlotLayoutEngine) -> None:
    from cluster.engine.errors import RequestRejected

    engine = slot_layout_engine("contiguous", num_device_blocks=32)
    with pytest.raises(RequestRejected, match="parallel sampling needs the 'paged' layout"):
        engine.add_request(
            engine.request_builder.build({"prompt_token_ids": [300, 301]}, SamplingParams(n=2))
        )
