"""Streaming a request's outputs in O(new tokens): deltas, a coalescing mailbox, an accumulator.

The engine turns each step into one `RequestDelta` per touched request: only what is new since
the previous delta (text, token ids, logprobs) plus O(1) state, never a copy of the prompt or of
the output so far. A delta crosses process boundaries (a Serve handle) at that cost.

`OutputMailbox` is a stream's queue with a bound: deltas the reader has not taken yet are merged
into one pending delta, so a slow reader costs one merge per step (O(new tokens)) and holds at
most one pending item, never a queue of snapshots. A reader may also ask for at least N new
tokens per delta (`get(min_tokens)`, a server's `stream_interval`): fewer, larger items where
each item costs more than the step that made it (a hop between processes).

`chunk_tokens` is how many a reader asks for: a server's `stream_interval`, raised with the
number of running sequences when a replica bounds its chunks per decode step.

`OutputAccumulator` is the reader's side: it folds deltas into the public cumulative
`RequestOutput`. It appends to its own running lists instead of copying them, so each output
costs O(new tokens) (the cumulative `text` is a `str`, so it is the one thing re-built, a
character copy). Invariant for readers: the `token_ids` and `logprobs` lists of an output are
the stream's running lists: they are exact while the reader handles that output and keep
growing once it asks for the next one (copy them to keep a snapshot); `text` and the `delta_*`
fields never change after the fact. The final output (`finished`) is complete.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from cluster.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


@dataclass
class BranchDelta:
    """What one branch gained since the previous delta of its request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestDelta:
    """One request's change since its previous delta (see the module doc).

    `prompt_token_ids` is set on the first delta of a request only; `metrics` on the first and
    on the final one (in process it is the live object, so readers see it fill in)."""

    request_id: str
    branches: list[BranchDelta]
    finished: bool
    num_cached_tokens: int
    error: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    metrics: RequestMetrics | None = None
    served_by: str | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    """Set once, on the first delta after the whole prompt's logprobs are recorded."""


def chunk_tokens(stream_interval: int, chunks_per_step: int | None, running: int) -> int:
    """New tokens a stream's next chunk waits for: at least `stream_interval`, and with
    `chunks_per_step` set at least ceil(running / chunks_per_step), so the engine's streams send
    about `chunks_per_step` chunks per decode step however many sequences run (each running
    sequence gains one token per step). Light load keeps `stream_interval`; a saturated batch
    gets larger chunks, so the CPU the chunks cost in the processes that carry them (taken from
    the forward pass on a small CPU machine) stays a bounded share of a step."""
    if stream_interval < 1:
        raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
    if chunks_per_step is None:
        return stream_interval
    if chunks_per_step < 1:
        raise ValueError(f"chunks_per_step must be >= 1 or None, got {chunks_per_step}")
    return max(stream_interval, -(-running // chunks_per_step))


def _extend(into: BranchDelta | _BranchState, later: BranchDelta) -> None:
    """Appends `later`'s tokens and logprobs to `into` and takes its latest scalars (the text
    is each caller's own business: joined lazily when coalescing, appended when folding)."""
    into.token_ids.extend(later.token_ids)
    if later.logprobs is not None:
        if into.logprobs is None:
            into.logprobs = []
        into.logprobs.extend(later.logprobs)
    into.cumulative_logprob = later.cumulative_logprob
    into.finish_reason = later.finish_reason
    into.stop_reason = later.stop_reason


class _Coalesced:
    """Deltas of one request merged as they arrive: each merge costs O(what it carries) (text
    is kept in parts and joined once, when the reader takes it)."""

    def __init__(self, first: RequestDelta) -> None:
        self.head = first
        self.parts: dict[int, list[str]] = {b.index: [b.text] for b in first.branches}
        self.branches = {b.index: b for b in first.branches}
        self.count = 1
        self.tokens = self._most_tokens()

    def _most_tokens(self) -> int:
        """New tokens of the branch that has the most (branches advance together)."""
        return max((len(branch.token_ids) for branch in self.branches.values()), default=0)

    def merge(self, later: RequestDelta) -> None:
        if later.request_id != self.head.request_id:
            raise ValueError(f"cannot merge {later.request_id!r} into {self.head.request_id!r}")
        for branch in later.branches:
            into = self.branches.get(branch.index)
            if into is None:
                self.branches[branch.index] = branch
                self.parts[branch.index] = [branch.text]
                self.head.branches.append(branch)
                continue
            self.parts[branch.index].append(branch.text)
            _extend(into, branch)
        head = self.head
        head.finished = later.finished
        head.num_cached_tokens = later.num_cached_tokens
        head.error = later.error if later.error is not None else head.error
        head.metrics = later.metrics if later.metrics is not None else head.metrics
        head.served_by = later.served_by if later.served_by is not None else head.served_by
        if later.prompt_logprobs is not None:
            head.prompt_logprobs = later.prompt_logprobs
        self.count += 1
        self.tokens = self._most_tokens()

    def take(self) -> RequestDelta:
        for index, branch in self.branches.items():
            if len(self.parts[index]) > 1:
                branch.text = "".join(self.parts[index])
        return self.head


class OutputMailbox:
    """A single-reader stream of `RequestDelta`s that coalesces what the reader has not taken.

    Invariants: at most one delta is pending (later ones merge into it); an error put with
    `fail` is raised by `get` after the pending delta was taken; `get` returns deltas in order
    and never loses one; `get(min_tokens)` holds a delta back only while it has fewer than
    `min_tokens` new tokens, is not final, and the stream's first token went out already (so
    the time to the first token and to the end never wait on it), and a reader waiting for
    `min_tokens` is woken only once they are there (not once per step). Use from one event
    loop only."""

    def __init__(self) -> None:
        self._pending: _Coalesced | None = None
        self._error: BaseException | None = None
        self._tokens_taken = 0
        self._wanted = 1  # the waiting reader's min_tokens: a put below it does not wake it
        self._ready = asyncio.Event()
        self.merged = 0
        """How many deltas were merged into a pending one (the reader was behind)."""

    def put(self, delta: RequestDelta) -> None:
        if self._pending is None:
            self._pending = _Coalesced(delta)
        else:
            self._pending.merge(delta)
            self.merged += 1
        if self._deliverable(self._wanted):
            self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Ends the stream with `error` (after what is pending); the first error wins."""
        if self._error is None:
            self._error = error
        self._ready.set()

    @property
    def num_pending(self) -> int:
        """Deltas merged into the one waiting for the reader (0: nothing is waiting)."""
        return 0 if self._pending is None else self._pending.count

    def _deliverable(self, min_tokens: int) -> bool:
        if self._error is not None:
            return True
        pending = self._pending
        if pending is None:
            return False
        return (
            min_tokens <= 1
            or pending.tokens >= min_tokens
            or pending.head.finished
            or pending.head.error is not None
            or self._tokens_taken == 0
        )

    async def get(self, min_tokens: int = 1) -> RequestDelta:
        """The next (coalesced) delta: one with at least `min_tokens` new tokens, unless it is
        the final one or no token was taken yet (see the class doc)."""
        self._wanted = min_tokens
        while not self._deliverable(min_tokens):
            self._ready.clear()
            await self._ready.wait()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._tokens_taken += pending.tokens
            return pending.take()
        assert self._error is not None
        raise self._error


class _BranchState:
    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[Logprob] | None = None
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def apply(self, delta: BranchDelta) -> None:
        self.text += delta.text
        _extend(self, delta)

    def output(self, delta: BranchDelta | None) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=self.token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            delta_text=delta.text if delta is not None else "",
            delta_token_ids=delta.token_ids if delta is not None else [],
        )


class OutputAccumulator:
    """Folds one request's deltas into cumulative `RequestOutput`s (see the module doc)."""

    def __init__(self) -> None:
        self._branches: dict[int, _BranchState] = {}
        self._prompt: str | None = None
        self._prompt_token_ids: list[int] = []
        self._metrics: RequestMetrics | None = None
        self._prompt_logprobs: list[Logprob | None] | None = None

    def apply(self, delta: RequestDelta) -> RequestOutput:
        if delta.prompt_token_ids is not None:
            self._prompt = delta.prompt
            self._prompt_token_ids = delta.prompt_token_ids
        if delta.metrics is not None:
            self._metrics = delta.metrics
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        changes = {branch.index: branch for branch in delta.branches}
        for index, branch in changes.items():
            if index not in self._branches:
                self._branches[index] = _BranchState(index)
            self._branches[index].apply(branch)
        outputs = [
            self._branches[index].output(changes.get(index)) for index in sorted(self._branches)
        ]
        return RequestOutput(
            request_id=delta.request_id,
            prompt=self._prompt,
            prompt_token_ids=self._prompt_token_ids,
            outputs=outputs,
            finished=delta.finished,
            num_cached_tokens=delta.num_cached_tokens,
            metrics=self._metrics if self._metrics is not None else RequestMetrics(0.0),
            error=delta.error,
            served_by=delta.served_by,
            prompt_logprobs=self._prompt_logprobs,
        )
