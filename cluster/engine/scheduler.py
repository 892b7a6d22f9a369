"""Continuous batching over the paged KV cache: one `StepPlan` per step.

Every queue (waiting, running, swapped) is kept in `Request.queue_order`: priority, then arrival
(under `scheduling_policy: fcfs` every priority is 0, so arrival order alone; lower priority
values come first, vLLM's convention). Each step, in that order: running requests get their
pending token appended and their uncomputed tokens (a decode's one, a prefill's chunk) taken
from the step's budget, preempting the last running request in that order (the lowest
priority, latest arrival; recompute or swap, chosen by `PreemptionCostModel`) when no block is
free; then, if nothing was preempted, swapped requests come back, and only then are waiting
requests admitted, first in order first, the first that does not fit stopping admission. A
waiting request never preempts a running one. LoRA slots, speculative drafts and grammar
bitmasks ride the same pass (the whole policy is in docs/engine.md, "Scheduling").

Invariants: the running requests use at most `max_loras` distinct adapters, so every step's
adapters fit the device slots; a request waiting for a slot is not passed by one of its own
priority: while it waits no request with an adapter is admitted after it, so the running
adapter requests only drain (each ends within its max_tokens) until its adapter fits, and
being earlier in queue order it is then considered before any later request (a stream of
higher-priority requests can starve lower ones, as vLLM's priority policy can). The plan never
has two sequences writing one slot and every write goes to a block its writer holds alone (the
block manager's tables guarantee both); a request is in exactly one of waiting / running /
swapped, or finished; no sequence appears in a plan in the step it is released.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from block_manager import KVManager, NeverFits, NoFreeBlocks
from block_manager.protocol import cache_tier_of
from cluster.engine.config import SchedulerSettings
from cluster.engine.lookahead import Placeholders, lookahead_decodes
from cluster.engine.preemption import PreemptionCostModel, choose_swap
from cluster.engine.request import Branch, Request, RequestStatus
from cluster.engine.scheduler_step import (
    PreemptionCounts,
    ScheduledWork,
    SchedulerStep,
    sequence_work,
)
from cluster.engine.speculation import DraftAllowance, NgramSpeculator, SpeculationCounters
from cluster.engine.step_budget import StepBudget, prefill_cap
from cluster.engine.step_samples import take_samples
from workers.plan import PLACEHOLDER_TOKEN_ID, SampledToken, StepOutput, StepPlan


class Scheduler:
    """Owns the queues and drives the block manager; the engine owns I/O and text."""

    def __init__(
        self,
        settings: SchedulerSettings,
        block_manager: KVManager,
        cost_model: PreemptionCostModel,
        max_loras: int | None = None,
        speculator: NgramSpeculator | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """`max_loras`: distinct adapters the running requests may use (None: LoRA off).
        `speculator`: proposes drafts for decodes (None: speculative decoding off); drafts never
        take a sequence past `max_model_len`."""
        self.settings = settings
        self.bm = block_manager
        self.tier = cache_tier_of(block_manager)
        """The manager's CPU cache tier (None: its layout has none), driven every step."""
        self.cost_model = cost_model
        self.max_loras = max_loras
        self.speculator = speculator
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.preemptions = PreemptionCounts()
        self._releases: list[int] = []
        self._step_id = 0
        self._ahead = Placeholders(block_manager)

    # --- queue management ----------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        _insert_in_order(self.waiting, request)

    def speculation_counters(self) -> SpeculationCounters | None:
        """A copy of the speculator's counters (None: speculative decoding off)."""
        return None if self.speculator is None else self.speculator.counters.copy()

    def num_waiting_ahead(self, priority: int) -> int:
        """Waiting requests that start before a new one of `priority` (all under fcfs)."""
        return sum(1 for request in self.waiting if request.priority <= priority)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def has_releases(self) -> bool:
        """Some sequence ids the workers must forget have not been carried by a plan yet."""
        return bool(self._releases)

    def requeue_releases(self, seq_ids: list[int]) -> None:
        """Releases of a plan the workers refused (they applied none of it): send them again."""
        self._releases[:0] = seq_ids

    def unstick_head(self) -> Request | None:
        """Called after a `stalled` step. A swapped head that cannot
        come back is turned into a recompute (its CPU copy dropped, it waits again) and None is
        returned; a waiting head that cannot fit is removed and returned, to be rejected."""
        if self.swapped:
            request = self.swapped.pop(0)
            for branch in request.active_branches:
                self._drop_sequence(branch)
            request.status = RequestStatus.WAITING
            _insert_in_order(self.waiting, request)
            return None
        request = self.waiting.pop(0)
        for branch in request.branches:
            self._drop_sequence(branch)
        return request

    def finish_branch(self, request: Request, branch: Branch) -> None:
        """A branch ended: its blocks go back (sealed ones stay hit-able), workers forget it."""
        self._drop_sequence(branch)
        if request.finished:
            self._remove(request)
            request.status = RequestStatus.FINISHED

    def abort(self, request: Request) -> None:
        """Frees everything the request holds at once; marks unfinished branches aborted."""
        for branch in request.branches:
            if not branch.finished:
                branch.finish_reason = "abort"
            self._drop_sequence(branch)
        self._remove(request)
        request.status = RequestStatus.FINISHED

    # --- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerStep:
        if self._ahead:
            raise RuntimeError("a step is planned while a step planned ahead waits for tokens")
        self._step_id += 1
        step = SchedulerStep(plan=StepPlan(step_id=self._step_id), works=[])
        cap = prefill_cap(self.settings.max_prefill_tokens, self.running, self.bm)
        budget = StepBudget(self.settings.max_num_batched_tokens, cap)
        if self.tier is not None and self.tier.cpu_cache:
            self.tier.set_promotion(self.cost_model.prefer_promote(self.bm.block_size))
        step.preempted = self._schedule_running(step, budget)
        if not step.preempted:
            swapped_left = self._schedule_swapped(step, budget)
            if not swapped_left:
                self._schedule_waiting(step, budget)
        self._close_plan(step)
        idle = not (step.runs_anything or step.preempted or self.running or step.plan.released)
        step.stalled = idle and bool(self.waiting or self.swapped)
        return step

    def schedule_ahead(self, base: SchedulerStep) -> SchedulerStep | None:
        """Step `base`'s successor, planned while `base` runs (async scheduling): each of
        `base`'s decodes gets a placeholder for the token `base` samples, its slot appended now
        (`cluster.engine.lookahead` says when; None when not)."""
        decodes = lookahead_decodes(self, base)
        if decodes is None:
            return None
        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, placeholders_of=base.plan.step_id)
        step = SchedulerStep(plan=plan, works=[])
        works, sequences, copy_pairs = step.works, plan.sequences, plan.copy_pairs
        append_slot = self._ahead.append
        for request in decodes:  # a plain decode of `_schedule_chunks`, its token a placeholder
            branch = request.branches[0]
            seq_id = branch.seq_id
            position = len(branch.token_ids)
            copy = append_slot(seq_id, position)
            if copy is not None:
                copy_pairs.extend(copy.pairs())
            works.append(ScheduledWork(request, branch, position, 1, 1))
            sequences.append(
                sequence_work(
                    self.bm, request, branch, [PLACEHOLDER_TOKEN_ID], position, 1, 0, None, True
                )
            )
        self._close_plan(step)
        return step

    def _close_plan(self, step: SchedulerStep) -> None:
        """The plan carries every pending release and the CPU cache tier's copies."""
        step.plan.released = self._releases
        self._releases = []
        if self.tier is not None:
            transfers = self.tier.take_transfers(step.plan.step_id)
            step.plan.demote, step.plan.promote = transfers.demote, transfers.promote

    def on_step_done(
        self, step: SchedulerStep, output: StepOutput
    ) -> list[tuple[Request, Branch, SampledToken]]:
        """Marks the step's KV computed, forks parallel requests after their prompt, and returns
        every sampled token with its branch (the engine appends them as text and stops). A
        work whose branch ended while the step ran (async scheduling: a stop string found late,
        an abort, EOS sampled by the step before a step planned ahead), or whose request left
        the device meanwhile (a refused step before it), has its blocks freed already and gives
        nothing. A sampled token a step planned ahead holds a placeholder for is written in
        (`cluster.engine.step_samples`)."""
        if self.tier is not None:
            self.tier.complete_transfers(step.plan.step_id)  # its copies ran: blocks unpinned
        self.cost_model.observe_step(output.forward_seconds, step.num_tokens)
        return take_samples(step, output, self.bm, self._ahead, self.speculator)

    # --- running ---------------------------------------------------------------------------

    def _schedule_running(self, step: SchedulerStep, budget: StepBudget) -> bool:
        """Appends every running request's pending tokens, then schedules them; True if any
        was preempted. All appends come first so that drafts, which take blocks too, are only
        proposed from what the pending tokens left."""
        preemptions_before = self._num_preemptions()
        # all pending tokens fitted at once: nobody to preempt, the loop has nothing to do
        index = len(self.running) if self._append_all_pending(step) else 0
        while index < len(self.running):
            if self._append_pending(self.running[index], step, may_preempt=True):
                index += 1
            # else the request preempted itself: it was the last one, the loop ends
        drafts = self._draft_allowance()
        for request in self.running:
            self._schedule_chunks(request, step, budget, drafts)
        return self._num_preemptions() != preemptions_before

    def _append_all_pending(self, step: SchedulerStep) -> bool:
        """`_append_pending` of every running request at once when all their pending tokens
        fit now (the decode steps' case); False, appending nothing, when they do not (the
        requests then go one by one, preempting). One request's appends never change what
        another's need (only forks share a partial tail), so when they fit together they fit
        one after another, exactly as the loop would append them."""
        bm = self.bm
        num_tokens = bm.num_tokens
        pending: list[Branch] = []
        for request in self.running:
            for branch in request.active_branches:
                behind = len(branch.token_ids) - num_tokens(branch.seq_id)
                if behind == 1:
                    pending.append(branch)
                elif behind > 1:
                    return False  # the one-by-one loop raises, at the request it always did
        if not pending:
            return True
        if not bm.can_append([branch.seq_id for branch in pending]):
            return False
        append_token, copy_pairs = bm.append_token, step.plan.copy_pairs
        for branch in pending:
            copy = append_token(branch.seq_id, branch.token_ids[-1])
            if copy is not None:
                copy_pairs.extend(copy.pairs())
        return True

    def _append_pending(self, request: Request, step: SchedulerStep, *, may_preempt: bool) -> bool:
        """Gives each active branch a table slot for its sampled token, all branches at once.
        When the blocks are short, later requests in queue order are preempted (the last
        first: lowest priority, latest arrival), possibly this one; False when this request
        left the device or (without `may_preempt`) must wait."""
        pending = [
            b for b in request.active_branches if len(b.token_ids) > self.bm.num_tokens(b.seq_id)
        ]
        if not pending:
            return True
        seq_ids = [b.seq_id for b in pending]
        while not self.bm.can_append(seq_ids):
            if not may_preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is request:
                return False
        for branch in pending:
            if len(branch.token_ids) - self.bm.num_tokens(branch.seq_id) != 1:
                raise RuntimeError(f"sequence {branch.seq_id}: more than one token pending")
            copy = self.bm.append_token(branch.seq_id, branch.token_ids[-1])
            if copy is not None:
                step.plan.copy_pairs.extend(copy.pairs())
        return True

    def _schedule_chunks(
        self,
        request: Request,
        step: SchedulerStep,
        budget: StepBudget,
        allowance: DraftAllowance | None = None,
    ) -> None:
        """Adds each active branch's uncomputed tokens (within the budget) to the plan; with an
        `allowance`, a decode that samples one token also carries drafts. (A step planned
        ahead builds its placeholder decodes in `schedule_ahead`.)"""
        bm = self.bm
        for branch in request.active_branches:
            seq_id = branch.seq_id
            computed = bm.num_computed_tokens(seq_id)
            remaining = bm.num_tokens(seq_id) - computed
            if remaining <= 0:
                continue
            if not self.settings.enable_chunked_prefill and remaining > budget.room(remaining):
                continue
            chunk = budget.take(remaining)
            if chunk == 0:
                continue
            token_ids = branch.token_ids
            end = computed + chunk
            num_samples = (1 if request.forked else request.n) if end == len(token_ids) else 0
            drafts: Sequence[int] = ()
            if allowance is not None and chunk == 1 and num_samples == 1 and request.forked:
                assert self.speculator is not None
                drafts = self.speculator.draft_branch(
                    bm, request, branch, budget, allowance.next(), self.max_model_len
                )
            step.works.append(
                ScheduledWork(request, branch, computed, chunk + len(drafts), num_samples, drafts)
            )
            bitmask = None
            if branch.grammar is not None and num_samples > 0:
                branch.grammar.sync(branch.output_token_ids)
                bitmask = branch.grammar.bitmasks(drafts)
            tokens = token_ids[computed:end]
            targets = None
            if request.prompt_logprobs is not None:  # the prompt tokens after these positions
                prompt = request.prompt_token_ids
                targets = prompt[computed + 1 : min(end + 1, len(prompt))] or None
            step.plan.sequences.append(
                sequence_work(
                    bm,
                    request,
                    branch,
                    tokens + list(drafts) if drafts else tokens,
                    computed,
                    num_samples,
                    len(drafts),
                    bitmask,
                    False,
                    targets,
                )
            )

    # --- preemption ---------------------------------------------------------------------------

    def _preempt(self, request: Request, step: SchedulerStep) -> None:
        """Takes a running request off the device by swap or recompute (it leaves `running`)."""
        seq_ids = [b.seq_id for b in request.active_branches if self.bm.has_sequence(b.seq_id)]
        self.running.remove(request)
        mode = self.settings.preemption_mode
        if choose_swap(mode, self.bm, self.cost_model, request, seq_ids):
            pairs = self.bm.swap_out(seq_ids)
            request.swapped_blocks = len(pairs)  # shared blocks stay on the device
            step.plan.swap_out.extend(pairs)
            step.swapped.append(request)
            self._forget_on_workers(request.active_branches)
            request.status = RequestStatus.SWAPPED
            _insert_in_order(self.swapped, request)
            self.preemptions.swap += 1
        else:
            self._requeue(request)
            self.preemptions.recompute += 1

    def recompute(self, request: Request) -> None:
        """Sends a running or swapped request back to wait, its KV dropped on both tiers (it is
        recomputed from its tokens when admitted again): what a refused plan leaves of the
        requests it did not blame."""
        self._remove(request)
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        for branch in request.active_branches:
            self._drop_sequence(branch)
        request.status = RequestStatus.WAITING
        _insert_in_order(self.waiting, request)

    # --- swapped and waiting ------------------------------------------------------------------

    def _schedule_swapped(self, step: SchedulerStep, budget: StepBudget) -> bool:
        """Brings swapped requests back, first in queue order first; True if any is still
        swapped."""
        while self.swapped:
            request = self.swapped[0]
            seq_ids = [b.seq_id for b in request.active_branches]
            room_for_appends = request.swapped_blocks + len(seq_ids)
            if (
                not self._adapter_fits(request)
                or self._running_seqs() + len(seq_ids) > self.settings.max_num_seqs
                or self.bm.num_free_device_blocks() < room_for_appends
                or not self.bm.can_swap_in(seq_ids)
            ):
                return True
            step.plan.swap_in.extend(self.bm.swap_in(seq_ids))
            step.swapped.append(request)
            self.swapped.pop(0)
            request.status = RequestStatus.RUNNING
            _insert_in_order(self.running, request)
            if self._append_pending(request, step, may_preempt=False):
                self._schedule_chunks(request, step, budget)  # no drafts the step it returns
        return False

    def _schedule_waiting(self, step: SchedulerStep, budget: StepBudget) -> None:
        index = 0
        slot_blocked = False  # an earlier request waits for an adapter slot
        while index < len(self.waiting) and budget.room(2) > 0:
            request = self.waiting[index]
            if request.adapter_digest is not None and (
                slot_blocked or not self._adapter_fits(request)
            ):
                slot_blocked = True
                index += 1
                continue
            branches = request.active_branches
            if self._running_seqs() + _seq_demand(request) > self.settings.max_num_seqs:
                return
            if self._releases and not self._releases_carried(branches):
                return  # sent back this step (a refused plan): admitted once the release ran
            if not self.settings.enable_chunked_prefill and any(
                self._uncached_estimate(request, b)
                > budget.room(self._uncached_estimate(request, b))
                for b in branches
            ):
                return
            try:
                cached = self._allocate(request, branches)
            except NoFreeBlocks:
                return
            except NeverFits as error:
                self.waiting.pop(index)
                request.error = f"the request can never fit in the KV cache: {error}"
                request.status = RequestStatus.FINISHED
                step.rejected.append(request)
                continue
            if request.num_cached_tokens is None:
                request.num_cached_tokens = cached
            self.waiting.pop(index)
            request.status = RequestStatus.RUNNING
            _insert_in_order(self.running, request)
            self._schedule_chunks(request, step, budget)

    def _allocate(self, request: Request, branches: list[Branch]) -> int:
        """Allocates every branch's table, all or nothing; returns branch 0's cached tokens."""
        done: list[Branch] = []
        cached_first = 0
        try:
            for branch in branches:
                cached = self.bm.allocate(branch.seq_id, branch.token_ids, request.cache_key)
                if not done:
                    cached_first = cached
                done.append(branch)
        except (NoFreeBlocks, NeverFits):
            for branch in done:
                self.bm.free(branch.seq_id)
            raise
        return cached_first

    def _releases_carried(self, branches: list[Branch]) -> bool:
        """None of `branches` waits for its release to reach the workers (a plan must not
        release and schedule one sequence)."""
        pending = set(self._releases)
        return not any(branch.seq_id in pending for branch in branches)

    def _uncached_estimate(self, request: Request, branch: Branch) -> int:
        needed = self.bm.blocks_needed_to_allocate(branch.token_ids, request.cache_key)
        total_blocks = -(-len(branch.token_ids) // self.bm.block_size)
        cached_tokens = max(0, total_blocks - needed) * self.bm.block_size
        return len(branch.token_ids) - cached_tokens

    # --- helpers ------------------------------------------------------------------------------

    def _draft_allowance(self) -> DraftAllowance | None:
        if self.speculator is None:
            return None
        return self.speculator.allowance(self._running_seqs())

    def _adapter_fits(self, request: Request) -> bool:
        """Whether admitting `request` keeps the running adapters within `max_loras`."""
        digest = request.adapter_digest
        if digest is None or self.max_loras is None:
            return True
        running = {r.adapter_digest for r in self.running if r.adapter_digest is not None}
        return digest in running or len(running) < self.max_loras

    def seats_taken(self) -> bool:
        """The running requests hold every one of `max_num_seqs` (nothing can be admitted)."""
        return self._running_seqs() >= self.settings.max_num_seqs

    def _running_seqs(self) -> int:
        return sum(_seq_demand(r) for r in self.running)

    def _num_preemptions(self) -> int:
        return self.preemptions.recompute + self.preemptions.swap

    def _drop_sequence(self, branch: Branch) -> None:
        self._ahead.drop(branch.seq_id)
        if self.bm.has_sequence(branch.seq_id):
            self.bm.free(branch.seq_id)
        self._forget_on_workers([branch])

    def _forget_on_workers(self, branches: Iterable[Branch]) -> None:
        for branch in branches:
            if branch.worker_knows:
                self._releases.append(branch.seq_id)
            branch.forget_worker_state()

    def _remove(self, request: Request) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)


def _seq_demand(request: Request) -> int:
    """Sequences the request runs once forked (an unforked parallel request will need n)."""
    return len(request.active_branches) if request.forked else request.n


def _insert_in_order(queue: list[Request], request: Request) -> None:
    """Keeps `queue` sorted by `Request.queue_order`."""
    queue.insert(bisect.bisect_left(queue, request.queue_order, key=_queue_order), request)


def _queue_order(request: Request) -> tuple[int, int]:
    return request.queue_order
