"""The one step loop every driver runs (the offline `LLM` in its thread, the async engine on
its event loop): begin a step, launch its execution, apply its result in two halves.

With `overlap` off a step is `begin_step`, the execution, `advance_step`, `settle_step`, in a
row. With it on (`scheduler.async_scheduling`, as vLLM's `--async-scheduling`):

- after `settle_step` of step N-1, while step N runs, step N+1 is planned ahead
  (`EngineCore.begin_step_ahead`: N's decodes again, each token a placeholder the workers fill
  from N's output) and launched at once, so the workers start it as soon as N ends and the
  engine's whole step (`advance_step`, `settle_step`, planning the next) runs while they
  compute;
- when it cannot be planned ahead (an admission, a preemption, drafts, a grammar: see
  `cluster.engine.lookahead`), the next step is begun and launched right after `advance_step`
  of N, so only `settle_step` (text, stop strings, outputs, metrics) overlaps the workers.

What that trades: a branch that N's token ends (EOS, a stop token id, a stop string, found after
its next token was planned) or an abort ends while its next token is in flight has that token
computed and dropped (never reported), its blocks freed at once. Freeing blocks a step in flight
still writes is safe because nothing reuses a block before a later plan, and plans run in order
on the workers.

Invariants: at most two steps are in flight, the second only one planned ahead of the first;
`advance` is called once per launched step, oldest first, with its result, `settle` once after
each `advance`, before the next `advance`; the driver only waits on the handle `start` returns
(the oldest in flight). A launch returns a handle its driver knows how to wait on (a concurrent
future, an asyncio task); its value is `EngineCore.execute`'s (output, None for an empty plan,
or the exception the execution raised). Launches reach the workers in launch order.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Generic, TypeVar

from cluster.engine.scheduler_step import SchedulerStep
from cluster.engine.step_progress import StepProgress
from workers.plan import StepOutput

if TYPE_CHECKING:
    from cluster.engine.engine_core import EngineCore
    from cluster.engine.request import Request

Handle = TypeVar("Handle")


class StepPipeline(Generic[Handle]):
    """Drives `EngineCore`'s step path with at most two steps in flight (see the module doc)."""

    def __init__(
        self, core: EngineCore, launch: Callable[[SchedulerStep], Handle], *, overlap: bool
    ) -> None:
        self.core = core
        self.overlap = overlap
        self._launch = launch
        self._in_flight: deque[tuple[SchedulerStep, Handle]] = deque()
        self._progress: StepProgress | None = None
        self._plan_ahead = False

    @property
    def in_flight(self) -> Handle | None:
        """The handle of the oldest step the workers run now (None: none)."""
        return self._in_flight[0][1] if self._in_flight else None

    @property
    def handles(self) -> list[Handle]:
        """Every step in flight's handle, oldest first."""
        return [handle for _, handle in self._in_flight]

    def start(self) -> Handle | None:
        """The oldest step in flight, begun and launched here when none is and there is work;
        None when idle."""
        if not self._in_flight and self.core.has_work():
            step = self.core.begin_step()
            self._in_flight.append((step, self._launch(step)))
        return self.in_flight

    def advance(
        self, result: StepOutput | BaseException | None, *, launch_next: bool = True
    ) -> SchedulerStep:
        """The oldest step in flight gave `result`: its first half is applied and, with
        overlap (and `launch_next`), the next step launched unless one planned ahead is in
        flight already; returns the step. `settle` must follow."""
        assert self._in_flight and self._progress is None
        step, _ = self._in_flight.popleft()
        self._progress = self.core.advance_step(step, result)
        self._plan_ahead = self.overlap and launch_next
        if self._plan_ahead:
            self.start()
        return step

    def settle(self) -> list[Request]:
        """The second half of the last advanced step: the requests to report. With overlap,
        then the step after the one in flight is planned ahead and launched when it can be."""
        assert self._progress is not None
        progress, self._progress = self._progress, None
        reported = self.core.settle_step(progress)
        if self._plan_ahead and len(self._in_flight) == 1:
            ahead = self.core.begin_step_ahead(self._in_flight[0][0])
            if ahead is not None:
                self._in_flight.append((ahead, self._launch(ahead)))
        self._plan_ahead = False
        return reported

    def drain(self, wait: Callable[[Handle], StepOutput | BaseException | None]) -> None:
        """Ends what a driver that stopped early left (a settle owed, steps in flight, whose
        results `wait` gives), launching nothing; their reports are dropped (the driver has
        ended or aborted those requests)."""
        if self._progress is not None:
            self._plan_ahead = False
            self.settle()
        while self._in_flight:
            self.advance(wait(self._in_flight[0][1]), launch_next=False)
            self.settle()


SWITCH_INTERVAL_S = 0.0005
"""The interpreter's thread switch interval while a `ThreadLauncher` runs steps in a thread:
when a step's execution ends, its thread needs the GIL for a moment (its output, the next
plan's placeholders) while the engine thread plans and settles; at the default 5 ms it can wait
that long, which would stretch the gap between two forward passes."""


class ThreadLauncher:
    """A thread driver's launch (the offline `LLM`'s): without overlap the execution runs at
    once in the calling thread (a done future, no thread hop); with it, in a thread of its own,
    so the caller settles and plans meanwhile (the stub's sleep, torch's kernels and Ray's waits
    release the GIL). With overlap the process's switch interval is at most
    `SWITCH_INTERVAL_S` until `close` (which puts the previous one back)."""

    def __init__(self, core: EngineCore, *, overlap: bool) -> None:
        self.core = core
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="pagedserve-step") if overlap else None
        )
        self._previous_interval: float | None = None
        if overlap:
            self._previous_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._previous_interval, SWITCH_INTERVAL_S))

    def __call__(self, step: SchedulerStep) -> Future[StepOutput | Exception | None]:
        if self._executor is not None:
            return self._executor.submit(self.core.execute, step)
        done: Future[StepOutput | Exception | None] = Future()
        done.set_result(self.core.execute(step))
        return done

    def close(self) -> None:
        """Waits for a launched execution, then ends the thread (idempotent)."""
        if self._executor is not None:
            self._executor.shutdown()
        if self._previous_interval is not None:
            sys.setswitchinterval(self._previous_interval)
            self._previous_interval = None
