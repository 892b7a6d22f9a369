"""The engine's LoRA side, as `EngineCore` uses it: resolving a request's adapter at admission,
loading adapters on the workers, placing a step's adapters in slots, and the per-adapter counts.

Invariants: a request admitted with an adapter holds that adapter's weights (`LoRAManager.hold`)
from admission until it ends, exactly once (`release` clears the request's digest); every plan's
sequences carry the slot their adapter was placed in for that plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.engine.cache_keys import RequestKeys
from cluster.engine.config import LoRASettings
from cluster.engine.errors import InvalidAdapter
from cluster.engine.lora_manager import LoRAManager, lora_disabled
from cluster.engine.lora_request import LoRARequest
from cluster.engine.request import Request
from cluster.engine.scheduler_step import SchedulerStep
from workers import WorkerGroup
from workers.lora import AdapterSummary


@dataclass
class AdapterCounts:
    """Per adapter name: requests admitted and tokens generated."""

    requests: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)


class EngineAdapters:
    """`manager` is None when LoRA is off (then any adapter asked for is RequestRejected)."""

    def __init__(
        self, settings: LoRASettings, workers: WorkerGroup, request_keys: RequestKeys
    ) -> None:
        self.workers = workers
        self.manager = LoRAManager(settings) if settings.enable_lora else None
        if self.manager is not None:
            request_keys.adapters = self.manager.digest_of  # one map: keys follow the names
        self.counts = AdapterCounts()

    def _require(self, name: str) -> LoRAManager:
        if self.manager is None:
            raise lora_disabled(name)
        return self.manager

    # --- adapters ------------------------------------------------------------------------------

    def load_weights(self, lora: LoRARequest) -> AdapterSummary | None:
        """Loads the adapter on every rank (blocking; safe beside a running step, it touches
        only the ranks' CPU stores). None when the name is already served from that path.
        Raises InvalidAdapter naming the problem (nothing served changes) or RequestRejected
        when LoRA is off. Call `register` with the result on the engine's thread."""
        manager = self._require(lora.lora_name)
        if not manager.check_new(lora):
            return None
        try:
            return self.workers.add_lora(lora.lora_path)
        except ValueError as error:
            raise InvalidAdapter(f"adapter {lora.lora_name!r}: {error}") from None

    def register(self, lora: LoRARequest, summary: AdapterSummary | None) -> None:
        if summary is not None:
            self._require(lora.lora_name).register(lora, summary)

    def remove(self, name: str) -> None:
        self._require(name).remove(name)

    def list(self) -> list[LoRARequest]:
        return [] if self.manager is None else self.manager.list()

    # --- requests -------------------------------------------------------------------------------

    def digest_for(self, name: str | None) -> str | None:
        """The weights digest of the adapter a request names (None: the base model). Raises
        RequestRejected when LoRA is off, AdapterNotFound for a name not loaded."""
        if name is None:
            return None
        return self._require(name).resolve(name)

    def admit(self, request: Request) -> None:
        """The request is queued: it holds its adapter's weights until `release`."""
        if self.manager is None or request.adapter_digest is None:
            return
        assert request.adapter_name is not None
        self.manager.hold(request.adapter_digest)
        counts = self.counts.requests
        counts[request.adapter_name] = counts.get(request.adapter_name, 0) + 1

    def on_tokens(self, request: Request, count: int) -> None:
        """The request generated `count` more tokens (counted per adapter)."""
        if request.adapter_name is not None:
            tokens = self.counts.tokens
            tokens[request.adapter_name] = tokens.get(request.adapter_name, 0) + count

    def release(self, request: Request) -> None:
        """The request ended (once: its digest is cleared)."""
        if self.manager is not None and request.adapter_digest is not None:
            self.manager.release(request.adapter_digest)
            request.adapter_digest = None

    # --- steps ----------------------------------------------------------------------------------

    def place(self, step: SchedulerStep) -> None:
        """Slots for the step's adapters: slot loads and CPU drops into the plan, each
        sequence's slot into its work (the scheduler's works and the plan's are in one order)."""
        if self.manager is None:
            return
        digests = {w.request.adapter_digest for w in step.works} - {None}
        placed, loads = self.manager.assign(digests)  # type: ignore[arg-type]
        step.plan.lora_loads = loads
        if not step.is_empty:  # else the drops wait for a plan that reaches the workers
            step.plan.lora_drops = self.manager.take_drops()
        for work, sequence in zip(step.works, step.plan.sequences, strict=True):
            digest = work.request.adapter_digest
            sequence.lora_slot = -1 if digest is None else placed[digest]

    def invalidate_slots(self) -> None:
        """After a refused plan: its slot loads may have half run; load again on next use."""
        if self.manager is not None:
            self.manager.invalidate_slots()

    @property
    def loads(self) -> int:
        return 0 if self.manager is None else self.manager.counters.loads

    @property
    def evictions(self) -> int:
        return 0 if self.manager is None else self.manager.counters.evictions
