"""The one step loop every driver runs (the offline `LLM` in its thread, the async engine on
its event loop): begin a step, launch its execution, apply its result in two halves.

With `overlap` off a step is `begin_step`, the execution, `advance_step`, `settle_step`, in a
row. With it on (`scheduler.async_scheduling`, as vLLM's `--async-scheduling`) the next step is
begun and launched right after `advance_step`, so `settle_step` (text, stop strings, outputs,
metrics) runs while the workers compute the next step. What that trades: a branch a stop string
ends has one more token computed, which is dropped (never reported) and its blocks freed; an
abort or a stop string frees blocks of a sequence the step in flight still writes, which is safe
because every plan after it runs after it on the workers.

Invariants: at most one step is in flight; `advance` is called once per launched step with its
result, `settle` once after each `advance`, before the next `advance`; the driver only waits on
the handle `start` returns. A launch returns a handle its driver knows how to wait on (a
concurrent future, an asyncio task); its value is `EngineCore.execute`'s (output, None for an
empty plan, or the exception the execution raised).
"""

from __future__ import annotations

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
    """Drives `EngineCore`'s step path with at most one step in flight (see the module doc)."""

    def __init__(
        self, core: EngineCore, launch: Callable[[SchedulerStep], Handle], *, overlap: bool
    ) -> None:
        self.core = core
        self.overlap = overlap
        self._launch = launch
        self._in_flight: tuple[SchedulerStep, Handle] | None = None
        self._progress: StepProgress | None = None

    @property
    def in_flight(self) -> Handle | None:
        """The handle of the step the workers run now (None: none)."""
        return None if self._in_flight is None else self._in_flight[1]

    def start(self) -> Handle | None:
        """The step in flight, begun and launched here when none is and there is work; None
        when idle."""
        if self._in_flight is None and self.core.has_work():
            step = self.core.begin_step()
            self._in_flight = (step, self._launch(step))
        return self.in_flight

    def advance(
        self, result: StepOutput | BaseException | None, *, launch_next: bool = True
    ) -> SchedulerStep:
        """The step in flight gave `result`: its first half is applied and, with overlap (and
        `launch_next`), the next step launched; returns the step. `settle` must follow."""
        assert self._in_flight is not None and self._progress is None
        step, _ = self._in_flight
        self._in_flight = None
        self._progress = self.core.advance_step(step, result)
        if self.overlap and launch_next:
            self.start()
        return step

    def settle(self) -> list[Request]:
        """The second half of the last advanced step: the requests to report."""
        assert self._progress is not None
        progress, self._progress = self._progress, None
        return self.core.settle_step(progress)

    def drain(self, wait: Callable[[Handle], StepOutput | BaseException | None]) -> None:
        """Ends what a driver that stopped early left (a settle owed, a step in flight, whose
        result `wait` gives), launching nothing; their reports are dropped (the driver has
        ended or aborted those requests)."""
        if self._progress is not None:
            self.settle()
        if self._in_flight is not None:
            self.advance(wait(self._in_flight[1]), launch_next=False)
            self.settle()


class ThreadLauncher:
    """A thread driver's launch (the offline `LLM`'s): without overlap the execution runs at
    once in the calling thread (a done future, no thread hop); with it, in a thread of its own,
    so the caller settles the previous step meanwhile (the stub's sleep, torch's kernels and
    Ray's waits release the GIL)."""

    def __init__(self, core: EngineCore, *, overlap: bool) -> None:
        self.core = core
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="pagedserve-step") if overlap else None
        )

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
