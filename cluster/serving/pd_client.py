"""`DisaggregatedClient`: the `EngineClient` of a prefill/decode disaggregated application.

One request becomes two engine calls (`cluster.engine.handoff`): a prefill-only call to the
prefill deployment (routed by prefix, as a colocated request is), whose one delta, the first
token, goes to the client at once; then a resumed call to the decode deployment (routed by KV
pressure) with that token, the same sampling parameters and seed, and a hint naming where the
prompt's KV lies (`KVSourceHint`: the prefill replica and the prompt's chain; the decode
engine pulls those blocks through the KV transport, `cluster.kv_transfer`), which streams the
rest. The client sees one ordinary stream: the first delta carries the prompt; the usage,
the cached-token count and the request's timings are those of the whole request.

Invariants:
- an unseeded request gets a seed drawn here, so both engines draw from the same stream;
- a request the hand-off cannot carry (n > 1, or one token wanted) runs whole on the decode
  deployment;
- the prefill call is made again once (Serve routes it to a live replica) when its replica
  died before answering; the decode call likewise, as long as it streamed nothing; any later
  failure ends the stream with the error (the front ends turn it into an error event);
- closing the stream closes whichever engine call is open, which aborts it there and frees its
  blocks; a finished prefill call holds no blocks but its prefix cache's;
- the decode engine computes whatever it cannot pull (the hint is advice, never a
  requirement).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from cluster.engine.client import EngineClient
from cluster.engine.errors import EngineDead, RequestFailed
from cluster.engine.generate_request import GenerateRequest
from cluster.engine.handoff import HANDOFF_FINISH
from cluster.engine.output_stream import BranchDelta, RequestDelta
from cluster.engine.outputs import RequestMetrics
from cluster.kv_transfer.hint import KVSourceHint
from workers.plan import SampledToken

DeltaStream = AsyncGenerator[RequestDelta, None]


@dataclass
class Handoff:
    """What the prefill call handed over: the tokens it sampled (with log-probabilities), the
    replica that ran it, its cached-token count and timings."""

    tokens: list[SampledToken]
    served_by: str | None
    num_cached_tokens: int
    metrics: RequestMetrics | None


def disaggregable(request: GenerateRequest) -> bool:
    """Whether the hand-off can carry the request: one branch, more than one token wanted."""
    max_tokens = request.params.max_tokens
    return request.params.n == 1 and (max_tokens is None or max_tokens > 1)


def with_seed(request: GenerateRequest, rng: random.Random) -> GenerateRequest:
    if request.params.seed is not None:
        return request
    params = dataclasses.replace(request.params, seed=rng.randrange(2**63))
    return dataclasses.replace(request, params=params)


def sampled_tokens(branch: BranchDelta) -> list[SampledToken]:
    """A branch delta's tokens as the sampler gave them (what a resumed branch replays)."""
    if branch.logprobs is None:
        return [SampledToken(token) for token in branch.token_ids]
    return [SampledToken(lp.token_id, lp.logprob, tuple(lp.top.items())) for lp in branch.logprobs]


def as_running(delta: RequestDelta) -> RequestDelta:
    """The prefill call's hand-off delta as a client sees it: the branch goes on."""
    branches = [
        dataclasses.replace(b, finish_reason=None, stop_reason=None)
        if b.finish_reason == HANDOFF_FINISH
        else b
        for b in delta.branches
    ]
    return dataclasses.replace(delta, branches=branches, finished=False)


def whole_metrics(prefill: RequestMetrics | None, decode: RequestMetrics) -> RequestMetrics:
    """The request's timings from both calls: arrival and first token from the prefill call,
    the rest from the decode call, the gap between the two calls as an inter-token time."""
    if prefill is None:
        return decode
    gaps = list(decode.inter_token_times)
    if prefill.first_token_time is not None and decode.first_token_time is not None:
        gaps.insert(0, max(0.0, decode.first_token_time - prefill.first_token_time))
    return RequestMetrics(
        arrival_time=prefill.arrival_time,
        first_scheduled_time=prefill.first_scheduled_time,
        first_token_time=prefill.first_token_time,
        last_token_time=decode.last_token_time,
        finished_time=decode.finished_time,
        inter_token_times=gaps,
    )


class DisaggregatedClient:
    """Runs each request as a prefill call then a decode call (see the module doc)."""

    def __init__(
        self,
        prefill: EngineClient,
        decode: EngineClient,
        *,
        pull: bool = True,
        prefill_deployment: str | None = None,
        attempts: int = 2,
        rng: random.Random | None = None,
    ) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.prefill = prefill
        self.decode = decode
        self.pull = pull
        self.prefill_deployment = prefill_deployment
        """The prefill replicas' Serve deployment, named in the hint (the decode replica pulls
        from a deployment not its own)."""
        self.attempts = attempts
        self.rng = rng or random.Random()

    async def generate(self, request: GenerateRequest) -> DeltaStream:
        if not disaggregable(request):
            async with aclosing(self._retried(self.decode, request)) as whole:
                async for delta in whole:
                    yield delta
            return
        request = with_seed(request, self.rng)
        prefill = dataclasses.replace(request, prefill_only=True)
        handoff: Handoff | None = None
        tokens: list[SampledToken] = []
        async with aclosing(self._retried(self.prefill, prefill)) as first:
            async for delta in first:
                for branch in delta.branches:
                    tokens.extend(sampled_tokens(branch))
                if delta.finished and _handed_off(delta):
                    handoff = Handoff(
                        tokens, delta.served_by, delta.num_cached_tokens, delta.metrics
                    )
                    delta = as_running(delta)
                yield delta
        if handoff is None:
            return  # the request ended on the prefill side (EOS, a stop, its grammar)
        decode = dataclasses.replace(
            request, resume=tuple(handoff.tokens), kv_source=self._hint(handoff, request)
        )
        async with aclosing(self._retried(self.decode, decode)) as rest:
            async for delta in rest:
                delta.prompt = None
                delta.prompt_token_ids = None
                delta.num_cached_tokens = handoff.num_cached_tokens
                if delta.finished and delta.metrics is not None:
                    delta.metrics = whole_metrics(handoff.metrics, delta.metrics)
                else:
                    delta.metrics = None
                yield delta

    def _hint(self, handoff: Handoff, request: GenerateRequest) -> KVSourceHint | None:
        """Where the decode engine pulls the prompt's blocks from: the prefill replica, for
        the chain the router keyed (none in process, or without a chain or pulls)."""
        if not self.pull or handoff.served_by is None or not request.block_hashes:
            return None
        return KVSourceHint(handoff.served_by, request.block_hashes, self.prefill_deployment)

    async def _retried(self, engine: EngineClient, request: GenerateRequest) -> DeltaStream:
        """`engine.generate(request)`, called again (up to `attempts` in all) when the replica
        died before its first delta; closing it closes the call."""
        for attempt in range(1, self.attempts + 1):
            stream = engine.generate(request)
            try:
                try:
                    first = await anext(stream)
                except StopAsyncIteration:
                    return
                except EngineDead as error:
                    if isinstance(error, RequestFailed) or attempt == self.attempts:
                        raise
                    continue
                yield first
                async for delta in stream:
                    yield delta
                return
            finally:
                await stream.aclose()


def _handed_off(delta: RequestDelta) -> bool:
    return any(branch.finish_reason == HANDOFF_FINISH for branch in delta.branches)
