"""Priority scheduling (`scheduler.scheduling_policy: priority`, vLLM's): waiting requests are
admitted by (priority, arrival), the lowest-priority running request is preempted first, a
request that arrives into a full queue with a better priority passes the ones waiting before it,
and preemption never changes a token. Under `fcfs` a non-zero priority is refused."""

from __future__ import annotations

import pathlib

import pytest

from cluster.engine.engine_core import EngineCore
from cluster.engine.errors import PriorityNotEnabled
from cluster.engine.llm import LLM
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import RequestStatus
from cluster.engine.sampling_params import SamplingParams
from tests.engine.conftest import SlotEngineFactory
from tests.engine.slot_workers import reference_tokens
from tests.engine.tiny_engine import (
    GREEDY,
    PREEMPTING,
    PROMPTS,
    assert_all_free,
    greedy_ids,
    tiny_config,
)

PRIORITY = {"scheduling_policy": "priority"}


def submit(
    engine: EngineCore, prompt: list[int], priority: int, max_tokens: int = 4
) -> tuple[str, SamplingParams]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = engine.request_builder.build({"prompt_token_ids": prompt}, params, priority=priority)
    return engine.add_request(request).request_id, params


def run_to_end(engine: EngineCore) -> tuple[dict[str, RequestOutput], list[str]]:
    """Every request's final output and the order in which they finished."""
    finals: dict[str, RequestOutput] = {}
    order: list[str] = []
    for _ in range(2_000):
        if not engine.has_unfinished():
            return finals, order
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
                order.append(output.request_id)
    raise AssertionError("no progress")


def test_waiting_requests_are_admitted_by_priority_then_arrival(
    slot_engine: SlotEngineFactory,
) -> None:
    """One seat: requests run one at a time, so the finish order is the admission order."""
    engine = slot_engine(scheduler={**PRIORITY, "max_num_seqs": 1})
    priorities = [5, 0, 5, -1, 0, 3]
    ids = [submit(engine, [300 + i, 301, 302], p)[0] for i, p in enumerate(priorities)]
    expected = [ids[i] for i in sorted(range(len(ids)), key=lambda i: (priorities[i], i))]
    assert [r.request_id for r in engine.scheduler.waiting] == expected
    _, finished = run_to_end(engine)
    assert finished == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize(
    ("policy", "priorities", "victim"),
    [
        ("priority", [9, 0, 0], 0),  # the lowest priority goes first, though it came first
        ("priority", [0, 4, 2], 1),
        ("fcfs", [0, 0, 0], 2),  # all equal: the latest arrival
    ],
)
def test_preemption_takes_the_lowest_priority_latest_arrival(
    slot_engine: SlotEngineFactory, mode: str, policy: str, priorities: list[int], victim: int
) -> None:
    """Three requests of one block each fill a six-block pool once they decode; the next block
    each wants runs the pool dry and exactly one is preempted: the last in (priority, arrival)
    order. Every output still equals the paging-free reference."""
    engine = slot_engine(
        num_device_blocks=7,
        num_cpu_blocks=16 if mode == "swap" else 0,
        block_size=4,
        scheduler={"scheduling_policy": policy, "preemption_mode": mode},
    )
    submitted = [submit(engine, [310 + i, 311, 312, 313], p, 8) for i, p in enumerate(priorities)]
    first_victim = None
    finals: dict[str, RequestOutput] = {}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        if first_victim is None and engine.scheduler.preemptions.recompute + (
            engine.scheduler.preemptions.swap
        ):
            off_device = [
                rid
                for rid, _ in submitted
                if engine.requests[rid].status in (RequestStatus.WAITING, RequestStatus.SWAPPED)
            ]
            first_victim = off_device
    assert first_victim == [submitted[victim][0]]
    counts = engine.scheduler.preemptions
    assert (counts.swap if mode == "swap" else counts.recompute) >= 1
    for i, (rid, params) in enumerate(submitted):  # greedy: the reference reads no seed
        expected = reference_tokens(
            [310 + i, 311, 312, 313],
            params.to_settings(0),
            branch_index=0,
            max_tokens=8,
            ignore_eos=True,
        )
        assert finals[rid].outputs[0].token_ids == expected


def test_fcfs_refuses_a_priority(slot_engine: SlotEngineFactory) -> None:
    engine = slot_engine()
    with pytest.raises(PriorityNotEnabled, match="--scheduling-policy priority"):
        submit(engine, [300, 301], 2)
    assert not engine.has_unfinished()
    submit(engine, [300, 301], 0)  # priority 0 is every fcfs request's


def test_high_priority_passes_a_saturated_queue_and_tokens_stay_exact(
    tiny_model_dir: pathlib.Path, roomy_outputs: list[RequestOutput]
) -> None:
    """The tiny Llama in a pool that preempts, three seats: six low-priority requests queue, then
    a high-priority one arrives; it finishes before every low-priority request still waiting
    when it came, and every output equals the roomy, unpreempted run's."""
    config = tiny_config(
        tiny_model_dir,
        cache=PREEMPTING["recompute"]["cache"],
        scheduler={**PRIORITY, "preemption_mode": "recompute", "max_num_seqs": 3},
    )
    with LLM(config=config) as llm:
        engine = llm.engine
        low = [
            engine.add_request(engine.request_builder.build(p, GREEDY, priority=10)).request_id
            for p in PROMPTS[:-1]
        ]
        engine.step()  # three low-priority requests run, the others wait
        waiting_before = [r.request_id for r in engine.scheduler.waiting]
        assert len(waiting_before) == len(low) - 3
        high = engine.add_request(
            engine.request_builder.build(PROMPTS[-1], GREEDY, priority=0)
        ).request_id
        finals, order = run_to_end(engine)
        assert all(order.index(high) < order.index(rid) for rid in waiting_before)
        got = [finals[rid].outputs[0].token_ids for rid in [*low, high]]
        assert got == [o.outputs[0].token_ids for o in roomy_outputs]
        assert llm.metrics().preemptions > 0
        assert_all_free(llm)
        with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
            llm.generate(PROMPTS[:2], GREEDY, priority=[1], use_tqdm=False)
        outputs = llm.generate(PROMPTS[:2], GREEDY, priority=[3, -3], use_tqdm=False)
        assert greedy_ids(outputs) == greedy_ids(roomy_outputs[:2])


def test_fcfs_llm_refuses_a_priority(tiny_model_dir: pathlib.Path) -> None:
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        with pytest.raises(PriorityNotEnabled, match="only supported with --scheduling-policy"):
            llm.generate(PROMPTS[:2], GREEDY, priority=[0, 1], use_tqdm=False)
        assert not llm.engine.has_unfinished()
