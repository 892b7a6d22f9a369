"""A rank's adapters: its slices of loaded adapters in CPU memory, and the device slots.

The engine decides everything (which adapters stay in CPU memory, which slot holds which
adapter); the rank obeys the plan: `StepPlan.lora_drops` (digests to drop from CPU memory), then
`StepPlan.lora_loads` (slot <- adapter, read from CPU memory, or from its directory again when it
was dropped, checked against its digest). A sequence's `lora_slot` must name a filled slot.

Invariant: a slot holds exactly the adapter whose digest `LoRASlots.contents` names; an adapter
read again from disk is used only if its digest is the one the engine asked for (a file changed
under a served name is refused, never served under the old cache key).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from workers.config import ModelSpec
from workers.lora.peft_format import load_peft_adapter
from workers.lora.shard import AdapterShard, shard_adapter
from workers.lora.slots import LoRASlots
from workers.parallel import TensorParallel
from workers.plan import PlanRejected, StepPlan


@dataclass(frozen=True)
class AdapterSummary:
    """What loading an adapter tells the engine."""

    digest: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    nbytes: int
    """This rank's share of the adapter's weights, in bytes (float32, CPU)."""


class RankLoRA:
    """One rank's adapter store and slots; `add_adapter` may run on another thread than the
    step (a dictionary insert under a lock); slots change only inside `apply`."""

    def __init__(
        self,
        spec: ModelSpec,
        tp: TensorParallel,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.spec = spec
        self.tp = tp
        self.max_rank = max_rank
        # On CPU the slots stay float32 whatever the model's dtype: the rank-r products cost
        # little there, and rounding A, B and the intermediate to bfloat16 cost the bfloat16
        # mode its parity with HF+PEFT float32 (tests/lora/test_smollm2_bfloat16_parity.py).
        # The Triton kernels on CUDA take the model's dtype.
        slot_dtype = torch.float32 if device.type == "cpu" else dtype
        self.slots = LoRASlots(spec, tp, max_loras, max_rank, slot_dtype, device)
        self.store: dict[str, AdapterShard] = {}
        self._lock = threading.Lock()

    def add_adapter(self, path: str) -> AdapterSummary:
        """Reads, validates and slices the adapter at `path` into CPU memory (keyed by its
        digest). Raises ValueError (an `AdapterFormatError`) naming the problem; nothing already
        loaded changes then."""
        weights = load_peft_adapter(path, self.spec, self.max_rank)
        shard = shard_adapter(weights, self.spec, self.tp)
        with self._lock:
            self.store.setdefault(shard.digest, shard)
        return AdapterSummary(
            weights.digest, weights.rank, weights.scaling, weights.target_modules, shard.nbytes
        )

    def resident(self) -> list[str]:
        with self._lock:
            return sorted(self.store)

    def check(self, plan: StepPlan) -> None:
        """Every sequence's slot in range, and filled (by now or by this plan's loads)."""
        filled = list(self.slots.contents)
        for load in plan.lora_loads:
            if not 0 <= load.slot < self.slots.max_loras:
                raise ValueError(
                    f"step {plan.step_id}: LoRA slot {load.slot} outside [0, "
                    f"{self.slots.max_loras})"
                )
            filled[load.slot] = load.digest
        for work in plan.sequences:
            slot = work.lora_slot
            if slot == -1:
                continue
            if not 0 <= slot < len(filled) or filled[slot] is None:
                raise PlanRejected(
                    f"step {plan.step_id}: sequence {work.seq_id} uses LoRA slot {slot}, which "
                    "holds no adapter",
                    (work.seq_id,),
                )

    def apply(self, plan: StepPlan) -> None:
        """The plan's drops, then its slot loads. Raises PlanRejected (blaming the sequences of
        the slot) when an adapter dropped from memory cannot be read again unchanged."""
        with self._lock:
            for digest in plan.lora_drops:
                self.store.pop(digest, None)
        for load in plan.lora_loads:
            if self.slots.contents[load.slot] == load.digest:
                continue
            with self._lock:
                shard = self.store.get(load.digest)
            if shard is None:
                shard = self._reload(plan, load.slot, load.digest, load.path)
            self.slots.fill(load.slot, shard)

    def _reload(self, plan: StepPlan, slot: int, digest: str, path: str) -> AdapterShard:
        users = tuple(w.seq_id for w in plan.sequences if w.lora_slot == slot)
        try:
            weights = load_peft_adapter(path, self.spec, self.max_rank)
        except ValueError as error:
            raise PlanRejected(
                f"step {plan.step_id}: adapter {path!r} could not be read again: {error}", users
            ) from None
        if weights.digest != digest:
            raise PlanRejected(
                f"step {plan.step_id}: adapter {path!r} changed on disk since it was loaded "
                "(its weights digest differs); load it again under a name",
                users,
            )
        shard = shard_adapter(weights, self.spec, self.tp)
        with self._lock:
            self.store[digest] = shard
        return shard
