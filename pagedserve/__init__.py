"""pagedserve's public Python API: `from pagedserve import LLM, SamplingParams`."""

from cluster.engine.config import EngineConfig
from cluster.engine.llm import LLM
from cluster.engine.lora_request import LoRARequest
from cluster.engine.outputs import CompletionOutput, RequestOutput
from cluster.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
]
