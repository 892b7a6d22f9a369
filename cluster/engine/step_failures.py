"""How a failed execution of a step's plan is judged: refused by the plan's own requests, or a
failure of the workers themselves.

Every rank validates a plan before any collective and applies none of a plan it refuses (a
ValueError, `PlanRejected` when it can name the sequences at fault), so a refusal ends only the
requests it is blamed on. Anything else (a dead rank actor, a lost connection, a collective
error) means the workers are broken.
"""

from __future__ import annotations

from workers.plan import PlanRejected
from workers.rank_results import is_actor_death


def blamed_sequences(error: BaseException) -> frozenset[int]:
    """The sequence ids a refused plan was blamed on (empty: the whole plan)."""
    cause = getattr(error, "cause", None)  # a Ray task error wraps what the rank raised
    for candidate in (error, cause):
        if isinstance(candidate, PlanRejected):
            return frozenset(candidate.seq_ids)
    return frozenset()


def step_failure_is_attributable(error: BaseException) -> bool:
    """Whether a failed worker call can be blamed on the plan (and so on its requests) rather
    than on the workers: a ValueError is the ranks' validation refusing the plan (a Ray task
    error whose cause is a ValueError is one too); a dead actor, a lost connection, a timeout
    or any other error is the workers' own failure."""
    try:
        from ray import exceptions as ray_errors
    except ImportError:  # pragma: no cover - ray is a dependency
        return isinstance(error, ValueError)
    if is_actor_death(error):
        return False
    if isinstance(error, ray_errors.RayTaskError):
        return isinstance(error.cause, ValueError)
    return isinstance(error, ValueError)
