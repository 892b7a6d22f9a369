"""A step's rank results: a dead rank is named as the cause even when its peers' collective
error arrives first, and a failure never waits for a rank that does not answer."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray import exceptions as ray_errors

from workers import rank_results
from workers.rank_results import gather_async, root_cause


async def after(seconds: float, value: object = None, error: BaseException | None = None) -> object:
    await asyncio.sleep(seconds)
    if error is not None:
        raise error
    return value


def test_root_cause_prefers_a_dead_actor_in_any_position() -> None:
    collective, death = RuntimeError("Connection closed by peer"), ray_errors.ActorDiedError()
    assert root_cause([collective, death]) is death
    assert root_cause([death, collective]) is death
    assert root_cause([collective, ValueError("x")]) is collective


def test_results_in_rank_order_when_every_rank_answers() -> None:
    refs = [after(0.02, "rank0"), after(0.0, "rank1")]
    assert asyncio.run(gather_async(refs)) == ["rank0", "rank1"]


def test_the_survivors_collective_error_first_still_raises_the_death() -> None:
    collective, death = RuntimeError("Connection closed by peer"), ray_errors.ActorDiedError()
    refs = [after(0.0, error=collective), after(0.05, error=death)]
    with pytest.raises(ray_errors.ActorDiedError) as raised:
        asyncio.run(gather_async(refs))
    assert raised.value.__cause__ is collective


def test_a_failure_waits_for_a_silent_rank_only_the_grace_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rank_results, "DEATH_GRACE_S", 0.1)
    collective = RuntimeError("Connection closed by peer")
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="closed by peer"):
        asyncio.run(gather_async([after(0.0, error=collective), after(60.0, "never")]))
    assert time.monotonic() - began < 5.0
