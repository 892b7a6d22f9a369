"""LoRA adapters on the workers: PEFT loading and validation (`peft_format`), the weights
digest, tensor-parallel slices (`shard`), device slots (`slots`), a rank's store
(`rank_state`) and the per-step delta (`apply`, over `pagedserve_kernels.lora`)."""

from workers.lora.apply import LoRAStep
from workers.lora.peft_format import AdapterFormatError, AdapterWeights, load_peft_adapter
from workers.lora.rank_state import AdapterSummary, RankLoRA

__all__ = [
    "AdapterFormatError",
    "AdapterSummary",
    "AdapterWeights",
    "LoRAStep",
    "RankLoRA",
    "load_peft_adapter",
]
