"""Property test: random workloads arriving over time, pool sizes, budgets, preemption modes,
scheduling policies (random priorities) and aborts over `SlotWorkers`; every finished branch
equals the paging-free reference, the block manager's integrity holds after every step, every
block is free at the end, and only a request that cannot run even alone in the whole pool is
ever given up on."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from tests.engine.conftest import SlotEngineFactory
from tests.engine.slot_workers import reference_tokens
from tests.engine.test_paging_slot_model import assert_all_blocks_free

request_strategy = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(300, 320), min_size=1, max_size=30),
        "n": st.integers(1, 3),
        "max_tokens": st.integers(1, 20),
        "temperature": st.sampled_from([0.0, 1.0]),
        "seed": st.integers(0, 3),
        "arrive_at_step": st.integers(0, 12),
        "abort_at_step": st.one_of(st.none(), st.integers(0, 30)),
        "priority": st.integers(-2, 2),
    }
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 4, 8]),
    spare_blocks=st.integers(0, 30),
    cpu_blocks=st.integers(0, 40),
    mode=st.sampled_from(["auto", "recompute", "swap"]),
    budget=st.integers(8, 64),
    prefix_caching=st.booleans(),
    prefill_cap=st.one_of(st.none(), st.integers(1, 16)),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_random_workloads_match_reference(
    slot_engine: SlotEngineFactory,
    requests: list[dict[str, Any]],
    block_size: int,
    spare_blocks: int,
    cpu_blocks: int,
    mode: str,
    budget: int,
    prefix_caching: bool,
    prefill_cap: int | None,
    policy: str,
) -> None:
    if mode == "swap" and cpu_blocks == 0:
        mode = "recompute"
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    engine = slot_engine(
        num_device_blocks=-(-longest // block_size) + 3 + spare_blocks,
        num_cpu_blocks=cpu_blocks,
        block_size=block_size,
        cache={"enable_prefix_caching": prefix_caching},
        scheduler={
            "preemption_mode": mode,
            "max_num_batched_tokens": budget,
            "max_num_seqs": 8,
            "max_prefill_tokens": prefill_cap,
            "scheduling_policy": policy,
        },
    )
    submitted: list[tuple[str, dict[str, Any], SamplingParams]] = []
    finals: dict[str, RequestOutput] = {}
    step = 0
    while len(submitted) < len(requests) or engine.has_unfinished():
        for spec in requests:
            if spec["arrive_at_step"] == step:
                params = SamplingParams(
                    n=spec["n"],
                    max_tokens=spec["max_tokens"],
                    temperature=spec["temperature"],
                    seed=spec["seed"],
                )
                priority = spec["priority"] if policy == "priority" else 0
                request = engine.add_request(
                    engine.request_builder.build(
                        {"prompt_token_ids": spec["prompt"]}, params, priority=priority
                    )
                )
                submitted.append((request.request_id, spec, params))
        for rid, spec, _ in submitted:
            if spec["abort_at_step"] == step and rid not in finals:
                aborted = engine.abort(rid)
                if aborted is not None:
                    finals[rid] = aborted.make_output()
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        step += 1
        assert step < 5_000, "no progress"
    for rid, spec, params in submitted:
        output = finals[rid]
        # only a request that cannot run even alone in the whole pool may be cut short
        alone = spec["n"] * (-(-(len(spec["prompt"]) + spec["max_tokens"]) // block_size) + 1)
        if output.error is not None:
            assert alone > engine.block_manager.num_device_blocks, output.error
            continue
        for completion in output.outputs:
            expected = reference_tokens(
                spec["prompt"],
                params.to_settings(spec["seed"]),
                branch_index=completion.index,
                max_tokens=spec["max_tokens"],
            )
            cut_short = completion.finish_reason == "length" and len(completion.token_ids) < len(
                expected
            )
            if cut_short:
                assert alone > engine.block_manager.num_device_blocks
            if completion.finish_reason == "abort" or cut_short:
                assert completion.token_ids == expected[: len(completion.token_ids)]
            else:
                assert completion.token_ids == expected
    event(f"recompute preemptions: {engine.scheduler.preemptions.recompute > 0}")
    event(f"swap preemptions: {engine.scheduler.preemptions.swap > 0}")
    event(f"rejected: {any(o.error for o in finals.values())}")
    cut = any(
        c.finish_reason == "length" and len(c.token_ids) < spec["max_tokens"]
        for (rid, spec, _) in submitted
        for c in finals[rid].outputs
    )
    event(f"cut short by the pool: {cut}")
    assert_all_blocks_free(engine)
