"""pagedserve's public Python API: `from pagedserve import LLM, SamplingParams`, and the rest."""

from cluster.engine.config import EngineConfig
from cluster.engine.llm import LLM
from cluster.engine.lora_request import LoRARequest
from cluster.engine.outputs import CompletionOutput, RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
