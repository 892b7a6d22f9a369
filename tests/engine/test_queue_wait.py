"""Admission by predicted wait: a burst the engine drains is queued whole; only a request the
measured drain rate says cannot start within `scheduler.max_queue_wait_s` is refused, with
Retry-After from that prediction."""

from __future__ import annotations

import pytest

from cluster.engine.errors import EngineOverloaded
from cluster.engine.queue_wait import QueueWait
from cluster.engine.sampling_params import SamplingParams
from tests.engine.conftest import SlotEngineFactory


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_prediction_follows_the_measured_departure_rate() -> None:
    clock = FakeClock()
    wait = QueueWait(window=4, stale_s=10.0, clock=clock)
    assert wait.predict(10) is None  # nothing measured: no prediction
    wait.observe_departure()
    assert wait.predict(10) is None  # one departure gives no rate
    for _ in range(3):
        clock.now += 0.5
        wait.observe_departure()
    # 3 intervals of 0.5 s in the window: 2 departures per second
    assert wait.rate() == pytest.approx(2.0)
    assert wait.predict(9) == pytest.approx(5.0)  # behind 9: the 10th departure from now
    clock.now += 1.5  # nothing left since: the rate decays with the clock
    assert wait.rate() == pytest.approx(1.0)
    clock.now += 10.0
    assert wait.predict(9) is None  # stale: an idle engine predicts nothing
    with pytest.raises(ValueError, match="window"):
        QueueWait(window=1)


def test_a_burst_queues_whole_until_the_drain_rate_predicts_too_long(
    slot_engine: SlotEngineFactory,
) -> None:
    clock = FakeClock()
    engine = slot_engine(
        scheduler={"max_num_seqs": 2, "max_queue_wait_s": 5.0},
        queue_wait=QueueWait(window=4, clock=clock),
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def add(i: int) -> None:
        engine.add_request(engine.request_builder.build({"prompt_token_ids": [7, i]}, params))

    # A cold engine has no rate: the whole burst is queued, none refused.
    for i in range(12):
        add(i)
    # Departures every 1 s: 1 request a second.
    while engine.recorder.num_finished_requests < 4:
        finished_before = engine.recorder.num_finished_requests
        engine.step()
        clock.now += engine.recorder.num_finished_requests - finished_before
    waiting = len(engine.scheduler.waiting)
    assert waiting >= 5
    rate = engine.queue_wait.rate()
    assert rate is not None
    predicted = (waiting + 1) / rate
    assert predicted > 5.0
    with pytest.raises(EngineOverloaded, match="max_queue_wait_s") as refused:
        add(99)
    assert refused.value.retry_after_s == pytest.approx(predicted - 5.0)
    # once the queue drains below the limit, requests are taken again
    while len(engine.scheduler.waiting) > 2:
        finished_before = engine.recorder.num_finished_requests
        engine.step()
        clock.now += 0.2 * (engine.recorder.num_finished_requests - finished_before)
    add(100)
    while engine.has_unfinished():
        engine.step()
    assert engine.recorder.num_finished_requests == 13


def test_no_limit_never_refuses_by_time(slot_engine: SlotEngineFactory) -> None:
    clock = FakeClock()
    engine = slot_engine(
        scheduler={"max_num_seqs": 1, "max_queue_wait_s": None},
        queue_wait=QueueWait(window=2, clock=clock),
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(3):
        engine.add_request(engine.request_builder.build({"prompt_token_ids": [5, i]}, params))
    while engine.recorder.num_finished_requests < 2:
        engine.step()
        clock.now += 100.0
    for i in range(5):  # the rate predicts hours; nothing is refused
        engine.add_request(engine.request_builder.build({"prompt_token_ids": [6, i]}, params))


def test_a_high_priority_request_is_judged_by_the_queue_ahead_of_it(
    slot_engine: SlotEngineFactory,
) -> None:
    """Under priority scheduling the predicted wait counts only the waiting requests that would
    start first: a burst at priority 5 makes a priority-5 newcomer too late, while a priority-0
    one, which passes them all, is taken."""
    clock = FakeClock()
    engine = slot_engine(
        scheduler={"max_num_seqs": 2, "max_queue_wait_s": 5.0, "scheduling_policy": "priority"},
        queue_wait=QueueWait(window=4, clock=clock),
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def add(i: int, priority: int) -> None:
        request = engine.request_builder.build(
            {"prompt_token_ids": [7, i]}, params, priority=priority
        )
        engine.add_request(request)

    for i in range(12):
        add(i, 5)
    while engine.recorder.num_finished_requests < 4:  # 1 departure a second
        finished_before = engine.recorder.num_finished_requests
        engine.step()
        clock.now += engine.recorder.num_finished_requests - finished_before
    with pytest.raises(EngineOverloaded, match="waiting ahead of it"):
        add(99, 5)
    add(100, 0)
    assert engine.scheduler.waiting[0].prompt_token_ids == [7, 100]


def test_a_full_queue_retries_after_its_predicted_room() -> None:
    """At `max_waiting_requests` the refusal's Retry-After is when the drain rate frees a place
    in the queue (one departure per request above the bound, plus one), 1 s with no rate."""
    from cluster.engine.admission_checks import check_queue
    from cluster.engine.config import SchedulerSettings

    settings = SchedulerSettings(max_waiting_requests=2, max_queue_wait_s=None)
    clock = FakeClock()
    wait = QueueWait(window=4, clock=clock)
    with pytest.raises(EngineOverloaded, match="max_waiting_requests") as cold:
        check_queue(2, settings, wait)
    assert cold.value.retry_after_s == 1.0
    for _ in range(3):  # a departure every 2 s: 0.5 per second
        wait.observe_departure()
        clock.now += 2.0
    clock.now -= 2.0
    with pytest.raises(EngineOverloaded) as full:
        check_queue(2, settings, wait)
    assert full.value.retry_after_s == pytest.approx(2.0)  # the next departure
    with pytest.raises(EngineOverloaded) as over:
        check_queue(3, settings, wait)  # one above the bound: two departures
    assert over.value.retry_after_s == pytest.approx(4.0)
