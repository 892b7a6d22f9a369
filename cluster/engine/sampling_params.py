"""vLLM-shaped sampling parameters, validated on construction."""

from __future__ import annotations

import copy
import math
from collections.abc import Collection
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

    As in vLLM: `presence_penalty` and `frequency_penalty` (in [-2, 2], OpenAI's) lower the
    logits of tokens already in the branch's output, once or once per occurrence;
    `repetition_penalty` (> 0, 1 disables it) divides the positive logits of tokens already in
    the prompt or output and multiplies the negative ones; `min_p` (in [0, 1]) keeps the tokens
    at least that fraction as likely as the most likely one; `logit_bias` adds to token ids'
    logits; until `min_tokens` tokens are out, EOS and `stop_token_ids` cannot be drawn and stop
    strings do not end the branch. These apply to greedy decoding too; reported
    log-probabilities stay the model's own.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    """Log-probabilities of the prompt's tokens (vLLM's): each prompt token's own and this many
    top alternatives at its position (0: its own only); the first token has none. The prompt is
    then computed whole, never read from the prefix cache."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last this many tokens (vLLM's; -1, the model's context, keeps
    what fits anyway: a longer prompt is refused either way)."""

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(
                _is_number(value) and -2.0 <= value <= 2.0,
                f"{name} must be in [-2, 2], got {value!r}",
            )
        _require(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
        )
        _require(
            _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        _require(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be an int >= 0, got {self.min_tokens!r}",
        )
        _require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        if self.logit_bias is not None:
            _require(
                isinstance(self.logit_bias, dict)
                and all(
                    isinstance(token, int) and token >= 0 and _is_number(bias)
                    for token, bias in self.logit_bias.items()
                ),
                "logit_bias must map token ids (ints >= 0) to finite numbers, got "
                f"{self.logit_bias!r}",
            )

        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            _require(
                bool(self.allowed_token_ids)
                and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids must be a non-empty list of token ids (ints >= 0), got "
                f"{self.allowed_token_ids!r}",
            )
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            self.bad_words = list(self.bad_words)
            _require(
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                f"bad_words must be a list of non-blank strings, got {self.bad_words!r}",
            )

        _require(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
            f"prompt_logprobs must be None or an int in [0, 20], got {self.prompt_logprobs!r}",
        )
        _require(
            self.truncate_prompt_tokens is None
            or (
                _is_int(self.truncate_prompt_tokens)
                and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)
            ),
            "truncate_prompt_tokens must be None, -1 or an int >= 1, got "
            f"{self.truncate_prompt_tokens!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self) -> SamplingParams:
        """An independent copy (vLLM's `SamplingParams.clone`): changing its lists leaves this
        one as it is."""
        return copy.deepcopy(self)

    def to_settings(
        self,
        seed: int,
        prompt_len: int = 0,
        eos_token_ids: Collection[int] = (),
        bad_words: tuple[tuple[int, ...], ...] = (),
    ) -> SamplingSettings:
        """The worker-side settings; `seed` is the request's effective seed, `prompt_len` its
        prompt's length (what the frequency and presence penalties leave out),
        `eos_token_ids` the model's (banned before `min_tokens` unless `ignore_eos`) and
        `bad_words` this request's bad words as token ids
        (`PromptRenderer.bad_words_token_ids`)."""
        stops = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
        return SamplingSettings(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=seed,
            logprobs=self.logprobs,
            min_p=float(self.min_p),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            logit_bias=tuple(sorted((t, float(b)) for t, b in (self.logit_bias or {}).items())),
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(sorted(stops)) if self.min_tokens else (),
            prompt_len=prompt_len,
            allowed_token_ids=tuple(sorted(set(self.allowed_token_ids or ()))),
            bad_words=bad_words,
            prompt_logprobs=self.prompt_logprobs,
        )


def _is_int(value: object) -> bool:
    """An int that is not a bool (True would pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
