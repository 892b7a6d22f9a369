"""The synchronous heart of the engine: requests in, one step at a time, outputs out.

`EngineCore` owns the worker group, the block manager (sized from what the workers agreed on),
the scheduler and the tokenizer; every request leaves through its `RequestEndings`. A step is
`begin_step()` (schedule, giving the plan), the workers' execution, then `advance_step()` (what
the next schedule needs: KV marked computed, tokens appended, the finishes that need no text, or
a refused plan isolated to its requests) and `settle_step()` (text, stop strings, metrics, the
requests to report). `StepPipeline` runs them for the offline `LLM` and the async engine alike,
with async scheduling planning the next step while the current one runs (`begin_step_ahead`:
placeholders for the tokens in flight) or, when it cannot, launching it between the two halves;
`step()` runs everything in a row. Nothing else drives a step.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from block_manager import CacheIdentity, CacheKey
from block_manager.protocol import block_events_of
from cluster.engine.admission_checks import check_fits, check_queue
from cluster.engine.cache_keys import CacheKeyFactory, RequestKeys
from cluster.engine.config import EngineConfig
from cluster.engine.detokenizer import IncrementalDetokenizer, TextTracker
from cluster.engine.engine_lora import EngineAdapters
from cluster.engine.errors import ConfigError, PriorityNotEnabled, RequestRejected
from cluster.engine.generate_request import GenerateRequest, RequestBuilder
from cluster.engine.generation_defaults import GenerationDefaults, load_generation_defaults
from cluster.engine.grammar_backend import CompiledConstraint, GrammarCompilerCache
from cluster.engine.grammar_guard import GuardedConstraint
from cluster.engine.handoff import check_handoff, hand_off, resume_request
from cluster.engine.lora_manager import LoRAManager
from cluster.engine.lora_request import LoRARequest
from cluster.engine.metrics import EngineMetrics, MetricsRecorder, collect_metrics
from cluster.engine.output_processor import StopLimits, append_sampled_token, apply_token_text
from cluster.engine.outputs import RequestMetrics, RequestOutput
from cluster.engine.preemption import PreemptionCostModel
from cluster.engine.queue_wait import QueueWait
from cluster.engine.reasoning import ThinkingGrammar, ThinkingTokens, thinking_tokens
from cluster.engine.request import Branch, Request
from cluster.engine.request_endings import RequestEndings
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler
from cluster.engine.scheduler_step import SchedulerStep
from cluster.engine.sequence_bounds import RequestBounds
from cluster.engine.speculation import NgramSpeculator
from cluster.engine.step_progress import AppliedToken, StepProgress, apply_texts
from cluster.engine.structured_outputs import ConstraintError
from cluster.engine.tokenization import PromptRenderer
from kv_layouts import build_kv_manager, layout_named
from workers import ModelInfo, WorkerGroup, load_tokenizer
from workers.lora import AdapterSummary
from workers.plan import StepOutput


class EngineCore:
    """Single-threaded engine state; not safe to call from two threads at once."""

    def __init__(
        self,
        config: EngineConfig,
        workers: WorkerGroup | None = None,
        *,
        tokenizer: Any | None = None,
        queue_wait: QueueWait | None = None,
        record_block_events: bool = False,
    ) -> None:
        """`workers` and `tokenizer` default to ones built from `config`, `queue_wait` to a
        fresh one (tests inject them). `scheduler.max_num_seqs: auto` is resolved here, in the
        engine's process (`EngineConfig.resolved`)."""
        config = config.resolved()
        self.config = config
        self.workers = workers if workers is not None else WorkerGroup(config.to_worker_config())
        info: ModelInfo = self.workers.model_info
        self.model_info = info
        self.max_model_len = info.max_model_len
        sched = config.scheduler
        try:
            sched.check_context(self.max_model_len)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.requests: dict[str, Request] = {}
        self.kv_layout = layout_named(config.cache.kv_layout)
        self.block_manager = build_kv_manager(
            self.kv_layout,
            config,
            info,
            self.workers.num_device_blocks,
            self.workers.num_cpu_blocks,
            bounds=RequestBounds(self.requests),
            record_events=record_block_events,
        )
        self.block_events = block_events_of(self.block_manager)
        """Seals and evictions for a cluster-wide index (None: the layout seals nothing)."""
        self.shares_prefixes = (
            self.kv_layout.shares_prefixes
            and config.cache.enable_prefix_caching
            and not self.model_info.kv_group_windows  # hybrid KV groups: no transfers
        )
        """Blocks are found by prefix hash: the cluster-wide index and KV transfers apply."""
        if tokenizer is None:
            tokenizer = load_tokenizer(config.model.model)
        self.renderer = PromptRenderer(tokenizer, info.vocab_size)
        self.request_builder = RequestBuilder(self.renderer, config.cache.block_size)
        self.generation_defaults: GenerationDefaults = load_generation_defaults(config.model)
        """What requests get for the sampling fields they leave unset (logged once here)."""
        cache_keys = CacheKeyFactory(
            CacheIdentity(
                model_weights_digest=info.weights_digest,
                tokenizer_digest=self.renderer.digest,
                dtype=info.dtype,
                kv_cache_dtype=info.kv_cache_dtype,
                block_size=config.cache.block_size,
                rope=info.rope,
                quantization=info.quantization
                + (" int8-activations" if info.quantized_activations else ""),
            )
        )
        self.request_keys = RequestKeys(cache_keys, config.cache.block_size)
        self.grammars = GrammarCompilerCache(
            tokenizer, info.vocab_size, info.eos_token_ids, self.renderer.digest
        )
        self.adapters = EngineAdapters(config.lora, self.workers, self.request_keys)
        self.scheduler = Scheduler(
            sched,
            self.block_manager,
            PreemptionCostModel(kv_bytes_per_block=info.kv_bytes_per_block),
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
            speculator=(
                NgramSpeculator(config.speculative)
                if config.speculative.speculative_method == "ngram"
                else None
            ),
            max_model_len=self.max_model_len,
        )
        self.limits = StopLimits(frozenset(info.eos_token_ids), self.max_model_len)
        self.recorder = MetricsRecorder()
        self.queue_wait = queue_wait if queue_wait is not None else QueueWait()
        self.endings = RequestEndings(
            self.requests,
            self.scheduler,
            self.block_manager,
            self.adapters,
            self.recorder,
            self.queue_wait,
        )
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.renderer.tokenizer

    # --- requests ------------------------------------------------------------------------

    def add_request(
        self, generate: GenerateRequest, constraint: CompiledConstraint | None = None
    ) -> Request:
        """Validates and queues a rendered request. Raises RequestRejected (never servable as
        asked) or EngineOverloaded (the waiting queue is full).

        A request with structured outputs has its constraint compiled here unless `constraint`
        (compiled ahead by `compile_constraint`, e.g. in a worker thread) is given; each branch
        gets a matcher of its own.

        Its first `shared_prefix_tokens` tokens (an operator-shared prefix, e.g. a system
        prompt) have their whole blocks cached without the tenant salt, so every tenant shares
        them, while every later block stays salted per tenant."""
        arrival = next(self._arrivals)
        request_id = generate.request_id if generate.request_id is not None else f"req-{arrival}"
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if generate.priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            raise PriorityNotEnabled(
                f"priority ({generate.priority}) is only supported with --scheduling-policy "
                "priority; this engine schedules fcfs (arrival order)"
            )
        scheduler = self.scheduler
        ahead = scheduler.num_waiting_ahead(generate.priority)
        check_queue(len(scheduler.waiting), self.config.scheduler, self.queue_wait, ahead)
        params = generate.params
        ids = generate.token_ids
        digest = self.adapters.digest_for(generate.adapter)
        check_fits(
            ids,
            params,
            max_model_len=self.max_model_len,
            settings=self.config.scheduler,
            block_size=self.config.cache.block_size,
            block_manager=self.block_manager,
            layout=self.kv_layout,
            vocab_size=self.renderer.vocab_size,
        )
        cache_key = self.cache_key_for(generate)
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        check_handoff(generate.resume, generate.prefill_only, params.n, max_tokens)
        if params.prompt_logprobs is not None and (generate.resume or generate.prefill_only):
            raise RequestRejected(
                "prompt_logprobs cannot be served with prefill/decode disaggregation: the "
                "prompt is computed on another engine"
            )
        if params.structured_outputs is not None and constraint is None:
            constraint = self.compile_constraint(generate)
        thinking = None
        if constraint is not None and generate.thinking is not None:
            thinking = self._thinking_tokens(generate)
        seed = params.seed if params.seed is not None else self._default_seed(arrival)
        request = Request(
            request_id=request_id,
            arrival_index=arrival,
            prompt=generate.prompt.text,
            prompt_token_ids=list(ids),
            params=params,
            settings=params.to_settings(
                seed,
                len(ids),
                self.limits.eos_token_ids,
                self.renderer.bad_words_token_ids(params.bad_words or ()),
            ),
            cache_key=cache_key,
            max_tokens=max_tokens,
            branches=[
                self._new_branch(ids, params, index, constraint, thinking)
                for index in range(params.n)
            ],
            metrics=RequestMetrics(arrival_time=time.time()),
            adapter_name=generate.adapter,
            adapter_digest=digest,
            prefill_only=generate.prefill_only,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
            priority=generate.priority,
        )
        resume_request(request, generate.resume, self.limits)
        self.adapters.admit(request)  # released by `RequestEndings.forget_limits`
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def compile_constraint(self, generate: GenerateRequest) -> CompiledConstraint | None:
        """The request's structured-outputs constraint compiled for this engine's vocabulary
        (cached; thread-safe, so it may run beside a step). None for an unconstrained request;
        RequestRejected naming the field for one that does not compile."""
        structured = generate.params.structured_outputs
        if structured is None:
            return None
        try:
            return self.grammars.compile(structured.spec)
        except ConstraintError as error:
            raise RequestRejected(str(error)) from None

    # --- adapters (see `EngineAdapters`) ----------------------------------------------------

    @property
    def lora(self) -> LoRAManager | None:
        """The adapter bookkeeping (None: LoRA off)."""
        return self.adapters.manager

    def load_lora_weights(self, lora: LoRARequest) -> AdapterSummary | None:
        """Loads on every rank, thread-safe beside a step; then `register_lora` (see
        `EngineAdapters.load_weights`)."""
        return self.adapters.load_weights(lora)

    def register_lora(self, lora: LoRARequest, summary: AdapterSummary | None) -> None:
        self.adapters.register(lora, summary)

    def add_lora(self, lora: LoRARequest) -> None:
        """Loads and serves the adapter, in this thread. Raises InvalidAdapter naming the
        problem, RequestRejected when LoRA is off."""
        self.register_lora(lora, self.load_lora_weights(lora))

    def remove_lora(self, lora_name: str) -> None:
        """Stops serving the name; requests running with it finish (see `LoRAManager`)."""
        self.adapters.remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.adapters.list()

    def cache_key_for(self, generate: GenerateRequest) -> CacheKey:
        """The key the request's blocks are cached under (see `RequestKeys.key_for`)."""
        return self.request_keys.key_for(generate)

    def abort(self, request_id: str) -> Request | None:
        """Frees everything the request holds; the ended request (finish_reason "abort"), None
        when the id is unknown."""
        return self.endings.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished() > 0

    def num_running(self) -> int:
        """Requests in the running batch now (each gains a token per decode step)."""
        return len(self.scheduler.running)

    def has_work(self) -> bool:
        """A step has something to give the workers: an unfinished request, or releases of
        ended ones that no plan has carried yet (without them the workers would keep the state,
        and a layout's pool the memory, of the last requests that ended)."""
        return self.has_unfinished() or self.scheduler.has_releases()

    # --- steps -------------------------------------------------------------------------------
    # One path for every driver: `begin_step()`, the workers execute `step.plan` (unless
    # `step.is_empty`), then `advance_step(step, output or the exception the execution raised)`
    # and `settle_step(progress)` (`finish_step` is both). `StepPipeline` drives it.

    def begin_step(self) -> SchedulerStep:
        """Schedules the next step; its plan carries every pending release."""
        return self._prepared(self.scheduler.schedule())

    def begin_step_ahead(self, base: SchedulerStep) -> SchedulerStep | None:
        """Async scheduling: schedules the step after `base` while `base` runs, its decodes'
        tokens placeholders for what `base` samples (`Scheduler.schedule_ahead`); None when it
        must wait for `base`'s output. Its execution must follow `base`'s on the workers."""
        step = self.scheduler.schedule_ahead(base)
        return None if step is None else self._prepared(step)

    def _prepared(self, step: SchedulerStep) -> SchedulerStep:
        bm = self.block_manager
        self.adapters.place(step)
        if self.config.scheduler.check_integrity:
            bm.check_integrity()
        self.recorder.observe_pressure(bm.pressure())
        return step

    def execute(self, step: SchedulerStep) -> StepOutput | Exception | None:
        """Runs the step's plan on the workers in this thread: their output, None for an empty
        plan, or the exception the execution raised (for `finish_step` to judge)."""
        if step.is_empty:
            return None
        try:
            return self.workers.execute(step.plan)
        except Exception as error:  # judged by finish_step: a refusal or a broken worker
            return error

    def finish_step(
        self, step: SchedulerStep, result: StepOutput | BaseException | None
    ) -> list[Request]:
        """Ends the step with what executing its plan gave (`advance_step`, then
        `settle_step`); returns the requests it touched (to make outputs or deltas of), the
        ones it ended included."""
        return self.settle_step(self.advance_step(step, result))

    def step(self) -> list[RequestOutput]:
        """One whole step in this thread: the outputs of the requests it touched."""
        step = self.begin_step()
        return [request.make_output() for request in self.finish_step(step, self.execute(step))]

    def advance_step(
        self, step: SchedulerStep, result: StepOutput | BaseException | None
    ) -> StepProgress:
        """The half of ending a step that the next `begin_step` depends on: KV marked
        computed, each sampled token appended, the finishes that need no text (EOS, stop
        token ids, the grammar, `max_tokens`, the model's length) applied and their blocks
        freed. The text and the reports are `settle_step`'s.

        `result` is the workers' output, None for an empty plan, or the exception the
        execution raised. A refused plan (`step_failure_is_attributable`) ends the requests it
        is blamed on with `request.failed` set and sends the step's other requests back to be
        recomputed; any other exception is raised again (the workers are broken). A token the
        grammar refuses ends its request alone. A token of a branch that ended meanwhile (a
        stop string found by the previous step's `settle_step`, an abort, the previous step's
        token for a step planned ahead) is dropped."""
        progress = StepProgress(step, time.time())
        progress.reported = [self.endings.reject_during_admission(r) for r in step.rejected]
        if isinstance(result, BaseException):
            progress.reported += self.endings.refuse_step(step, result)
            return progress
        if result is not None:
            self._append_output(progress, result)
        progress.reported += self.endings.resolve_stall(step)
        return progress

    def settle_step(self, progress: StepProgress) -> list[Request]:
        """The rest of ending a step: each token's text, stop strings (a branch a stop string
        ends drops its later tokens and frees its blocks), log-probabilities and latency
        metrics; returns the requests to report. A token whose text raises ends its request
        alone."""
        texts = apply_texts(progress.tokens)
        reported = list(progress.reported)
        for request, branch in texts.cut:
            self.scheduler.finish_branch(request, branch)
            if request.finished and request.request_id in self.requests:
                self.endings.complete(request, progress.now)
        for request, reason in texts.broken.values():
            reported += self.endings.fail(
                [request], f"the engine could not apply a token of this request: {reason}"
            )
        recorder, now = self.recorder, progress.now
        on_tokens, observe_tokens = self.adapters.on_tokens, recorder.observe_tokens
        generated = 0
        for request, count in texts.new_tokens.values():
            generated += count
            if request.adapter_name is not None:  # counted per adapter
                on_tokens(request, count)
            observe_tokens(request.metrics, now, count)
            reported.append(request)
        recorder.num_generated_tokens += generated
        return reported

    def _append_output(self, progress: StepProgress, output: StepOutput) -> None:
        step, now = progress.step, progress.now
        if output.corrupt_swap_ins:
            progress.reported += self.endings.fail_corrupt_swap_ins(step, output.corrupt_swap_ins)
        self.recorder.num_steps += 1
        for work in step.works:
            metrics = work.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        ended: dict[str, Request] = {}
        broken: dict[str, tuple[Request, str]] = {}
        tokens, limits = progress.tokens, self.limits
        for request, branch, sampled in self.scheduler.on_step_done(step, output):
            if branch.finish_reason is not None or (broken and request.request_id in broken):
                continue  # a speculative step's tokens after the branch's last are dropped
            try:
                end = append_sampled_token(request, branch, sampled, limits)
            except Exception as error:  # this request's token only: fail it alone
                broken[request.request_id] = (request, f"{type(error).__name__}: {error}")
                continue
            applied = AppliedToken(request, branch, sampled, end, len(branch.output_token_ids))
            tokens.append(applied)
            if request.prefill_only:  # its text decides between a stop and the hand-off
                apply_token_text(request, branch, sampled, end)
                applied.text_done = True
                hand_off(request, branch)
            if branch.finish_reason is not None:
                self.scheduler.finish_branch(request, branch)
                if request.finished:
                    ended[request.request_id] = request
        for request, reason in broken.values():
            ended.pop(request.request_id, None)
            progress.reported += self.endings.fail(
                [request], f"the engine could not apply a token of this request: {reason}"
            )
        if broken:
            progress.tokens = [t for t in progress.tokens if t.request.request_id not in broken]
        if self.config.scheduler.check_integrity:
            self.block_manager.check_integrity()
        for request in ended.values():
            self.endings.complete(request, now)

    def metrics(self) -> EngineMetrics:
        return collect_metrics(
            self.recorder,
            self.scheduler,
            self.block_manager,
            self.adapters,
            kv_bytes_per_block=self.model_info.kv_bytes_per_block,
        )

    def shutdown(self) -> None:
        self.workers.shutdown()

    # --- helpers -------------------------------------------------------------------------

    def _new_branch(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        index: int,
        constraint: CompiledConstraint | None,
        thinking: ThinkingTokens | None = None,
    ) -> Branch:
        """A branch; its grammar waits for the end of the thinking span when `thinking`."""
        detokenizer = IncrementalDetokenizer(
            self.renderer.token_decoder(params.skip_special_tokens), prompt_ids
        )
        branch = Branch(
            seq_id=next(self._seq_ids),
            index=index,
            token_ids=list(prompt_ids),
            text=TextTracker(
                detokenizer,
                params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            ),
            grammar=None if constraint is None else constraint.new_matcher(),
        )
        if thinking is not None and branch.grammar is not None:
            branch.grammar = ThinkingGrammar(branch.grammar, thinking)
        if branch.grammar is not None:  # a matcher's error fails this request alone
            branch.grammar = GuardedConstraint(branch.grammar)
        return branch

    def _thinking_tokens(self, generate: GenerateRequest) -> ThinkingTokens:
        """The thinking tags of a constrained request as token ids, with its opening."""
        assert generate.thinking is not None
        tokenizer = self.renderer.tokenizer
        try:
            return thinking_tokens(
                generate.thinking,
                lambda text: tokenizer.encode(text, add_special_tokens=False),
                lambda ids: self.renderer.decode(ids, skip_special_tokens=False),
                generate.token_ids,
            )
        except ValueError as error:
            raise RequestRejected(str(error)) from None

    def _default_seed(self, arrival: int) -> int:
        return (self.config.model.seed * 1_000_003 + arrival * 7919 + 1) % 2**63
