"""When an engine replica should get no traffic: its step loop died or was shut down, or it has
work but stopped stepping."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.client import EngineHealth
from cluster.engine.metrics import EngineMetrics


@dataclass
class StepProgress:
    """Stuck-engine detection from the engine's public metrics: it has requests running or
    waiting, yet its step count has not moved for `stuck_after_s` (a step loop that died with
    requests in flight looks the same). Returns the reason, or None while healthy."""

    stuck_after_s: float
    last_steps: int = -1
    last_change_s: float = 0.0
    was_idle: bool = True

    def problem(self, metrics: EngineMetrics, now_s: float) -> str | None:
        """The clock restarts whenever the engine stepped or was last seen without work."""
        idle = not (metrics.num_running + metrics.num_waiting)
        if metrics.num_steps != self.last_steps or idle or self.was_idle:
            self.last_steps, self.last_change_s, self.was_idle = metrics.num_steps, now_s, idle
            return None
        idle_s = now_s - self.last_change_s
        if idle_s < self.stuck_after_s:
            return None
        return (
            f"engine stuck: {metrics.num_running} running and {metrics.num_waiting} waiting "
            f"requests, no step for {idle_s:.0f} s"
        )


def replica_problem(
    health: EngineHealth, progress: StepProgress, metrics: EngineMetrics, now_s: float
) -> str | None:
    """Why a replica should not get traffic, or None: its engine's step loop died or was shut
    down (reported even while idle), or it has work but stopped stepping (`StepProgress`)."""
    if not health.alive:
        return health.error or "the engine is not running"
    return progress.problem(metrics, now_s)
