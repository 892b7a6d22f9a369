"""One step's results from every rank actor, a failure reported by its root cause.

When a rank actor dies mid-step, its peers' collectives fail as well (gloo: "Connection closed
by peer"), and whichever error arrives first would otherwise name the failure: the survivors'
collective error often does, hiding the death that caused it. So after the first failure the
other ranks get up to `DEATH_GRACE_S` to resolve, and an actor death among them is what is
raised (chained to the first error). Which errors count as failures of the workers rather than
of the plan is unchanged (`cluster.engine.step_failures`): both kinds raised here are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

DEATH_GRACE_S = 2.0


def is_actor_death(error: BaseException) -> bool:
    """A rank actor died or cannot be reached (rather than raised an error of its own)."""
    from ray import exceptions as ray_errors

    return isinstance(error, ray_errors.RayActorError | ray_errors.ActorUnavailableError)


def root_cause(errors: Sequence[BaseException]) -> BaseException:
    """The first actor death among `errors`, else the first error."""
    return next((error for error in errors if is_actor_death(error)), errors[0])


def gather(refs: Sequence[Any]) -> list[Any]:
    """`ray.get(refs)`, raising a dead rank's error before its peers' (see the module doc)."""
    import ray

    try:
        return ray.get(list(refs))
    except ray.exceptions.RayError as first:
        ray.wait(list(refs), num_returns=len(refs), timeout=DEATH_GRACE_S)
        errors: list[BaseException] = [first]
        for ref in refs:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError as error:
                errors.append(error)
        cause = root_cause(errors)
        if cause is first:
            raise
        raise cause from first


async def gather_async(refs: Sequence[Any]) -> list[Any]:
    """`asyncio.gather` over the refs, raising a dead rank's error before its peers' (see the
    module doc)."""

    async def result_of(ref: Any) -> Any:
        return await ref

    tasks = [asyncio.ensure_future(result_of(ref)) for ref in refs]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if pending:
            await asyncio.wait(pending, timeout=DEATH_GRACE_S)
        errors = [
            error
            for task in tasks
            if task.done() and not task.cancelled() and (error := task.exception()) is not None
        ]
    finally:
        for task in tasks:
            task.cancel()  # no-op on a finished task; a rank still running is not waited for
    if not errors:
        return [task.result() for task in tasks]
    first = next(
        error for task in done if not task.cancelled() and (error := task.exception()) is not None
    )
    cause = root_cause(errors)
    if cause is first:
        raise first
    raise cause from first
