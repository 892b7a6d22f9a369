"""`LoRARequest`: names a LoRA adapter for a request, in vLLM's shape.

`lora_name` is what clients select (`"model": "<lora_name>"` over HTTP, the `adapter` field over
gRPC, `GenerateRequest.adapter` inside); `lora_int_id` is the caller's positive integer id (kept
for vLLM compatibility; the engine keys adapters by name and caches them by weights digest);
`lora_path` is a directory in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`).

Invariant: two requests share KV blocks only when their adapters' weights are byte-identical
(the digest of the tensors is part of every block's cache key), whatever their names or paths.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One adapter as a caller names it (vLLM's `LoRARequest` fields and meanings)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty path")
