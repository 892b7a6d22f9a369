"""Every way a request leaves the engine: completed, aborted, failed, or rejected from the
queue, and the step outcomes that end requests (a plan the workers refused, a stalled queue
head, KV blocks whose copy back from the CPU failed its checksum).

`RequestEndings` is owned by `EngineCore` and shares its table of live requests. Invariants:
- a request is ended once: every path takes it out of the live table, `abort` and `fail` leave
  alone one that is no longer in it, and `complete` and `reject_during_admission` are given
  only requests the step at hand has just ended;
- every ended request gives back its blocks (through the scheduler, or before it got any), its
  reservations and its hold on its adapter's weights, has `metrics.finished_time` set and is
  counted in exactly one of the recorder's finished, aborted, failed or rejected counters;
- `QueueWait` sees the departures of the requests that complete, fail or are aborted;
- a failed request carries `failed` and an `error` naming why; every other request goes on.
"""

from __future__ import annotations

import logging
import time

from block_manager import KVManager
from cluster.engine.engine_lora import EngineAdapters
from cluster.engine.metrics import MetricsRecorder
from cluster.engine.queue_wait import QueueWait
from cluster.engine.request import Request, RequestStatus
from cluster.engine.scheduler import Scheduler
from cluster.engine.scheduler_step import SchedulerStep
from cluster.engine.step_failures import blamed_sequences, step_failure_is_attributable
from cluster.engine.step_progress import holders_of

log = logging.getLogger(__name__)


class RequestEndings:
    """Ends requests of the engine's live table `requests` and releases what they hold."""

    def __init__(
        self,
        requests: dict[str, Request],
        scheduler: Scheduler,
        block_manager: KVManager,
        adapters: EngineAdapters,
        recorder: MetricsRecorder,
        queue_wait: QueueWait,
    ) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.adapters = adapters
        self.recorder = recorder
        self.queue_wait = queue_wait

    def complete(self, request: Request, now: float) -> None:
        """A request whose every branch finished (its blocks freed by the scheduler)."""
        self.queue_wait.observe_departure()
        self.forget_limits(request)
        request.metrics.finished_time = now
        self.requests.pop(request.request_id, None)
        self.recorder.num_finished_requests += 1

    def abort(self, request_id: str) -> Request | None:
        """Frees everything the request holds; the ended request (finish_reason "abort"), None
        when the id is unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.abort(request)
        self.forget_limits(request)
        self.queue_wait.observe_departure()
        request.metrics.finished_time = time.time()
        self.recorder.num_aborted_requests += 1
        return request

    def fail(self, requests: list[Request], reason: str) -> list[Request]:
        """Ends `requests` (those still unfinished) with `reason` as their error, freeing what
        they hold, while every other request goes on; returns the ones it ended."""
        ended = []
        for request in requests:
            if self.requests.pop(request.request_id, None) is None:
                continue
            self.scheduler.abort(request)
            self.forget_limits(request)
            self.queue_wait.observe_departure()
            request.error = reason
            request.failed = True
            request.metrics.finished_time = time.time()
            self.recorder.num_failed_requests += 1
            ended.append(request)
        return ended

    def reject_during_admission(self, request: Request) -> Request:
        """A queued request that can no longer fit the device pool (the scheduler has taken it
        out of its queues). One that has generated tokens (it outgrew the pool) ends with
        finish_reason "length", keeping its text, as if the pool were its context; one that has
        not is finished with its error."""
        grown = any(branch.output_token_ids for branch in request.branches)
        for branch in request.branches:
            if branch.finished:
                continue
            if grown:
                branch.text.finish()
                branch.finish_reason = "length"
            else:
                branch.finish_reason = "abort"
        if grown:
            request.error = None
            self.recorder.num_finished_requests += 1
        else:
            self.recorder.num_rejected_requests += 1
        request.status = RequestStatus.FINISHED
        request.metrics.finished_time = time.time()
        self.requests.pop(request.request_id, None)
        self.forget_limits(request)
        return request

    def refuse_step(self, step: SchedulerStep, error: BaseException) -> list[Request]:
        """The workers refused the step's plan and applied none of it: end the requests it was
        blamed on (all of the step's when it names none), recompute the others whose state
        depended on it, send its releases again; everything else goes on. Any other failure
        (`step_failure_is_attributable` says which) is raised again: the workers are broken."""
        if not step_failure_is_attributable(error):
            raise error
        log.warning("step %d refused by the workers: %r", step.plan.step_id, error)
        self.scheduler.requeue_releases(step.plan.released)
        self.adapters.invalidate_slots()  # its slot loads may have half run
        blamed = blamed_sequences(error)
        involved = step.requests()
        guilty = [r for r in involved if not blamed or any(b.seq_id in blamed for b in r.branches)]
        if not guilty:  # the blamed sequence is not this step's: trust nothing of it
            guilty = involved
        reason = f"the step running this request failed: {type(error).__name__}: {error}"
        ended = self.fail(guilty, reason)
        guilty_ids = {r.request_id for r in guilty}
        for request in involved:  # the innocent: their tokens and text so far are kept
            alive = request.request_id in self.requests and not request.finished
            if alive and request.request_id not in guilty_ids:
                self.scheduler.recompute(request)
        return ended

    def resolve_stall(self, step: SchedulerStep) -> list[Request]:
        """After a `stalled` step the head of the queues cannot fit even in an empty device
        pool: a swapped head is sent back to be recomputed, a waiting head is finished with an
        error instead of waiting forever. (Judged when scheduling: a request that arrived while
        the plan executed was never considered.)"""
        if not step.stalled or self.scheduler.running or self.scheduler.num_unfinished() == 0:
            return []
        request = self.scheduler.unstick_head()
        if request is None:
            return []
        request.error = (
            "the request cannot be scheduled even with every device block free "
            f"({self.block_manager.num_device_blocks} blocks, watermark "
            f"{self.block_manager.watermark_blocks})"
        )
        return [self.reject_during_admission(request)]

    def fail_corrupt_swap_ins(
        self, step: SchedulerStep, pairs: list[tuple[int, int]]
    ) -> list[Request]:
        """Blocks copied back from the CPU failed their checksum: they become unfindable in
        both tiers and every request holding one fails now, its step's tokens dropped, so the
        wrong KV is never served (nor sealed under a hash later lookups could hit)."""
        bad = {device for _, device in pairs}
        self.block_manager.discard(sorted(bad), [cpu for cpu, _ in pairs])
        self.recorder.swap_checksum_failures += len(pairs)
        victims = holders_of(self.block_manager, self.scheduler.running, bad)
        step.works = [work for work in step.works if work.request not in victims]
        return self.fail(
            victims,
            f"KV integrity: {len(pairs)} block(s) copied back from the CPU tier failed their "
            "checksum; the request is failed rather than served from wrong KV",
        )

    def forget_limits(self, request: Request) -> None:
        """What an ending request gives back besides its blocks: its hold on its adapter's
        weights (once: the digest is cleared)."""
        self.adapters.release(request)
