"""The engine's adapters: names served, the CPU-resident LRU, and which adapter each device slot
holds. The workers obey what this decides (see `workers.lora.rank_state`).

Adapters are keyed by their weights digest, not their name: two names for byte-identical weights
share one CPU copy, one slot and their cached KV blocks; a name is only how callers select them.

Policy and invariants:
- **Names.** `add` loads the adapter on every rank, then serves it under its name; adding a name
  again with the same path is a no-op, with another path it is refused (remove it first).
  `remove` stops serving the name at once (new requests get AdapterNotFound); requests already
  admitted hold the weights (a count per digest) and finish with them; weights no name serves
  and no request holds are forgotten (dropped from CPU memory, their slot freed).
- **CPU LRU.** At most `max_cpu_loras` adapters stay in the ranks' CPU memory; loading or using
  another evicts the least recently used one not needed by the current step (`lora_drops` in the
  next plan). An evicted adapter stays served: a slot load reads it again from its directory
  (the ranks check its digest).
- **Slots.** `assign` gives every adapter of a step a slot: the one it holds, else an empty one
  (lowest first, so the step's slots stay a narrow range), else the least recently used slot
  whose adapter is not in the step. The scheduler never puts more than `max_loras` distinct
  adapters in a step, so `assign` always succeeds.
- A plan the workers refused may have filled some slots and not others: `invalidate_slots`
  forgets what every slot holds, so the next use loads again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from cluster.engine.config import LoRASettings
from cluster.engine.errors import AdapterNotFound, InvalidAdapter, RequestRejected
from cluster.engine.lora_request import LoRARequest
from workers.lora import AdapterSummary
from workers.plan import LoRASlotLoad


@dataclass
class _Weights:
    """One adapter's weights, whatever names serve them."""

    digest: str
    path: str
    summary: AdapterSummary
    names: set[str] = field(default_factory=set)
    holders: int = 0
    """Requests admitted with these weights and not ended."""


@dataclass
class LoRACounters:
    loads: int = 0
    """Adapters loaded into a device slot (each slot fill)."""
    evictions: int = 0
    """Adapters displaced from a slot by another, plus adapters dropped from CPU memory by the
    LRU."""


class LoRAManager:
    """Name -> adapter, digest -> weights, slot -> digest; touched only on the engine's thread."""

    def __init__(self, settings: LoRASettings) -> None:
        self.max_loras = settings.max_loras
        self.max_cpu_loras = settings.max_cpu_loras or settings.max_loras
        self.names: dict[str, LoRARequest] = {}
        """Served names, in load order."""
        self.digest_of: dict[str, str] = {}
        """Served name -> weights digest (what the cache keys read)."""
        self.weights: dict[str, _Weights] = {}
        self.cpu: OrderedDict[str, None] = OrderedDict()
        """Digests resident in the ranks' CPU memory, least recently used first."""
        self.slots: list[str | None] = [None] * settings.max_loras
        self._slot_used: list[int] = [0] * settings.max_loras
        self._clock = 0
        self._drops: list[str] = []
        self.counters = LoRACounters()

    # --- names ------------------------------------------------------------------------------

    def check_new(self, lora: LoRARequest) -> bool:
        """Whether `lora` still has to be loaded (False: already served from the same path).
        Raises InvalidAdapter when its name is served from another path."""
        served = self.names.get(lora.lora_name)
        if served is None:
            return True
        if served.lora_path != lora.lora_path:
            raise InvalidAdapter(
                f"adapter {lora.lora_name!r} is already loaded from {served.lora_path!r}; "
                "remove it before loading another path under that name"
            )
        return False

    def register(self, lora: LoRARequest, summary: AdapterSummary) -> None:
        """Serves `lora` (its weights already loaded on every rank, `summary` says what).

        Loading runs off the engine's thread, so another `add` of the same name may have been
        registered meanwhile: this one then lost (InvalidAdapter for another path, a no-op for
        the same), and weights it loaded that nothing serves are dropped from the ranks with
        the next plan instead of staying in their memory."""
        try:
            fresh = self.check_new(lora)
        except InvalidAdapter:
            self._drop_if_unserved(summary.digest)
            raise
        if not fresh:
            self._drop_if_unserved(summary.digest)
            return
        weights = self.weights.get(summary.digest)
        if weights is None:
            weights = self.weights[summary.digest] = _Weights(
                summary.digest, lora.lora_path, summary
            )
        weights.names.add(lora.lora_name)
        self.names[lora.lora_name] = lora
        self.digest_of[lora.lora_name] = summary.digest
        self._touch_cpu(summary.digest, keep={summary.digest})

    def remove(self, name: str) -> None:
        """Stops serving `name`; raises AdapterNotFound when it is not served."""
        if name not in self.names:
            raise AdapterNotFound(f"adapter {name!r} is not loaded")
        del self.names[name]
        digest = self.digest_of.pop(name)
        weights = self.weights[digest]
        weights.names.discard(name)
        self._forget_if_unused(weights)

    def resolve(self, name: str) -> str:
        """The weights digest served under `name`; raises AdapterNotFound."""
        digest = self.digest_of.get(name)
        if digest is None:
            served = sorted(self.names) or "none"
            raise AdapterNotFound(f"adapter {name!r} is not loaded (loaded: {served})")
        return digest

    def list(self) -> list[LoRARequest]:
        return list(self.names.values())

    # --- requests -------------------------------------------------------------------------------

    def hold(self, digest: str) -> None:
        """A request was admitted with these weights."""
        self.weights[digest].holders += 1

    def release(self, digest: str) -> None:
        """A request holding these weights ended."""
        weights = self.weights.get(digest)
        if weights is None:
            return
        weights.holders -= 1
        self._forget_if_unused(weights)

    # --- slots ----------------------------------------------------------------------------------

    def assign(self, digests: set[str]) -> tuple[dict[str, int], list[LoRASlotLoad]]:
        """A slot for each adapter of the step, and the slot loads that puts them there."""
        if len(digests) > self.max_loras:
            raise RuntimeError(
                f"{len(digests)} adapters in one step exceed max_loras {self.max_loras}"
            )
        self._clock += 1
        placed: dict[str, int] = {}
        for slot, digest in enumerate(self.slots):
            if digest in digests:
                placed[digest] = slot
        loads: list[LoRASlotLoad] = []
        for digest in sorted(digests - set(placed)):
            slot = self._free_slot(set(placed.values()), digests)
            if self.slots[slot] is not None:
                self.counters.evictions += 1
            self.slots[slot] = digest
            placed[digest] = slot
            loads.append(LoRASlotLoad(slot, digest, self.weights[digest].path))
            self.counters.loads += 1
        for digest, slot in placed.items():
            self._slot_used[slot] = self._clock
            self._touch_cpu(digest, keep=digests)
        return placed, loads

    def take_drops(self) -> list[str]:
        drops, self._drops = self._drops, []
        return drops

    def invalidate_slots(self) -> None:
        self.slots = [None] * self.max_loras

    # --- helpers --------------------------------------------------------------------------------

    def _free_slot(self, taken: set[int], needed: set[str]) -> int:
        for slot, digest in enumerate(self.slots):
            if digest is None and slot not in taken:
                return slot
        candidates = [s for s, d in enumerate(self.slots) if s not in taken and d not in needed]
        return min(candidates, key=lambda s: self._slot_used[s])

    def _touch_cpu(self, digest: str, keep: set[str]) -> None:
        self.cpu[digest] = None
        self.cpu.move_to_end(digest)
        while len(self.cpu) > self.max_cpu_loras:
            victim = next((d for d in self.cpu if d not in keep), None)
            if victim is None:
                return
            del self.cpu[victim]
            self._drops.append(victim)
            self.counters.evictions += 1

    def _drop_if_unserved(self, digest: str) -> None:
        if digest not in self.weights and digest not in self._drops:
            self._drops.append(digest)

    def _forget_if_unused(self, weights: _Weights) -> None:
        if weights.names or weights.holders > 0:
            return
        del self.weights[weights.digest]
        if weights.digest in self.cpu:
            del self.cpu[weights.digest]
            self._drops.append(weights.digest)
        self.slots = [None if d == weights.digest else d for d in self.slots]


def lora_disabled(name: str) -> RequestRejected:
    return RequestRejected(
        f"adapter {name!r} was asked for but LoRA is not enabled on this engine "
        "(start it with enable_lora=True)"
    )
