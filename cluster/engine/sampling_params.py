"""vLLM-shaped sampling parameters, validated on construction."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from cluster.engine.structured_outputs import StructuredOutputsParams
from workers.plan import SamplingSettings


@dataclass
class SamplingParams:
    """How to generate for one request.

    `temperature == 0` is greedy. `top_k <= 0` (0 or -1) and `top_p == 1` disable those filters.
    `max_tokens=None` means "until the model's context is full". `seed=None` draws a fresh seed
    per request; a given seed makes the request's text reproducible regardless of batching,
    preemption or swapping. `stop` strings end a branch wherever they appear in its text, even split
    across tokens; the matched string is left out of the text unless `include_stop_str_in_output`.
    `structured_outputs` constrains every branch's output to a JSON schema, regex, choice or
    grammar (see `cluster.engine.structured_outputs`); a branch whose grammar completes ends with
    finish_reason "stop".
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _require(isinstance(self.n, int) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}")
        _require(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}",
        )
        _require(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature!r}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(
            isinstance(self.top_k, int) and self.top_k >= -1,
            f"top_k must be -1, 0 (disabled) or a positive int, got {self.top_k!r}",
        )
        _require(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            f"seed must be None or an int in [0, 2**63), got {self.seed!r}",
        )
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a list of non-empty strings, got {self.stop!r}",
        )
        _require(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}",
        )
        _require(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            f"logprobs must be None or an int in [0, 20], got {self.logprobs!r}",
        )
        _require(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be None or a StructuredOutputsParams, got "
            f"{type(self.structured_outputs).__name__}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self) -> SamplingParams:
        """An independent copy (vLLM's `SamplingParams.clone`): changing its lists leaves this
        one as it is."""
        return copy.deepcopy(self)

    def to_settings(self, seed: int) -> SamplingSettings:
        """The worker-side settings; `seed` is the request's effective seed."""
        return SamplingSettings(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=seed,
            logprobs=self.logprobs,
        )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
