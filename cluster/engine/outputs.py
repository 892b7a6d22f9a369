"""vLLM-shaped request outputs, as streamed to callers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time() seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def mean_tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if not self.inter_token_times:
            return None
        return sum(self.inter_token_times) / len(self.inter_token_times)


@dataclass(frozen=True)
class TokenLogprob:
    """vLLM's `Logprob`: one candidate token's log-probability at a position and its rank among
    that position's candidates (1 is the most likely; None where it is not among the top
    alternatives computed). `decoded_token` is always None here: the text is the output's."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class Logprob(Mapping[int, TokenLogprob]):
    """One generated position's log-probabilities: the sampled token (`token_id`, `logprob`) and
    the top alternatives (`top`, token id -> logprob).

    It also reads as vLLM's per-position `dict[int, Logprob]`: token id -> `TokenLogprob`, the
    sampled token first, then the alternatives from the most likely down, so
    `output.logprobs[i][output.token_ids[i]].logprob` works as it does with vLLM. A position
    without a sampled log-probability maps only its alternatives."""

    token_id: int
    logprob: float | None
    top: dict[int, float] = field(default_factory=dict)

    def _ranked(self) -> dict[int, TokenLogprob]:
        ranked = sorted(self.top.items(), key=lambda item: -item[1])
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(ranked, start=1)}
        entries: dict[int, TokenLogprob] = {}
        if self.logprob is not None:
            entries[self.token_id] = TokenLogprob(self.logprob, ranks.get(self.token_id))
        for token_id, logprob in ranked:
            entries.setdefault(token_id, TokenLogprob(logprob, ranks[token_id]))
        return entries

    def __getitem__(self, token_id: int) -> TokenLogprob:
        return self._ranked()[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ranked())

    def __len__(self) -> int:
        return len(self._ranked())


@dataclass
class CompletionOutput:
    """One branch of a request. `text` and `token_ids` are cumulative; the deltas hold what is new
    since this stream's previous output. `finish_reason` is "stop", "length" or "abort" once done;
    `stop_reason` is the matched stop string or stop token id (None for EOS or length)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class RequestOutput:
    """A snapshot of one request: every branch's output so far (ordered by index)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    """Set when the engine gave up on the request (e.g. it can never fit the KV cache)."""
    served_by: str | None = None
    """The engine replica that produced it, when it crossed a deployment handle."""
    prompt_logprobs: list[Logprob | None] | None = None
    """With `SamplingParams.prompt_logprobs`: one entry per prompt token, None for the first
    (vLLM's: `out.prompt_logprobs[i][out.prompt_token_ids[i]].logprob`)."""

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=sum(len(o.token_ids) for o in self.outputs),
            cached_tokens=self.num_cached_tokens,
        )
