"""Tensor-parallel workers: model shards, KV pool shards, the CPU swap tier, one step per call.

The public API: `WorkerConfig` in, `WorkerGroup` (with its `ModelInfo`) executing one
`workers.plan.StepPlan` per step, plus `resolve_model_path` and `load_tokenizer` for the engine.
"""

from workers.config import ModelInfo, WorkerConfig
from workers.group import WorkerGroup
from workers.model_source import resolve_model_path
from workers.plan import (
    SampledToken,
    SamplingSettings,
    SequenceWork,
    StepOutput,
    StepPlan,
)
from workers.tokenizer import load_tokenizer

__all__ = [
    "ModelInfo",
    "SampledToken",
    "SamplingSettings",
    "SequenceWork",
    "StepOutput",
    "StepPlan",
    "WorkerConfig",
    "WorkerGroup",
    "load_tokenizer",
    "resolve_model_path",
]
