"""pagedserve's public Python API: `from pagedserve import LLM, SamplingParams`."""

from cluster.config import EngineConfig
from cluster.llm import LLM
from cluster.outputs import CompletionOutput, RequestOutput
from cluster.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
