"""Handing one request from a prefill engine to a decode engine (prefill/decode disaggregation).

A disaggregated request runs twice, on two engines that share the model, the tokenizer and the
cache keys:
- on the prefill engine as `GenerateRequest(prefill_only=True)`: it computes the prompt's KV,
  samples the first token and ends there with finish_reason `HANDOFF_FINISH` (never shown to a
  client). Its text is taken as a running branch's is (a tail that may begin a stop string
  stays held back, an incomplete character stays unshown), so what the client saw of the first
  token is exactly what a colocated stream shows after one token; its full prompt blocks stay
  in the prefix cache, sealed under the request's keys;
- on the decode engine with `resume` set to the tokens the prefill engine sampled (with their
  log-probabilities): the branch starts as if it had sampled them itself (`resume_branch`):
  they count towards `max_tokens`, the grammar matcher has accepted them, the detokenizer and
  the stop-string search have seen them and their text is marked streamed, and the next draw is
  output index `len(resume)`, so a seeded request continues its own random stream.

Invariants: a resumed request has one branch (n == 1) and fewer resumed tokens than it may
generate; the decode engine's deltas never repeat a resumed token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cluster.engine.errors import RequestRejected
from workers.plan import SampledToken

if TYPE_CHECKING:
    from cluster.engine.output_processor import StopLimits
    from cluster.engine.request import Branch, Request

HANDOFF_FINISH = "handoff"
"""The finish reason of a prefill-only request that sampled its first token and stopped."""


def check_handoff(
    resume: Sequence[SampledToken], prefill_only: bool, n: int, max_tokens: int
) -> None:
    """Raises RequestRejected unless a request of `n` branches that may generate `max_tokens`
    tokens can be prefill-only or resumed from `resume` as asked."""
    if not resume and not prefill_only:
        return
    if n != 1:
        raise RequestRejected(f"a prefill-only or resumed request must have n == 1, got n={n}")
    if resume and prefill_only:
        raise RequestRejected("a request is either prefill-only or resumed, not both")
    if len(resume) >= max_tokens:
        raise RequestRejected(
            f"{len(resume)} resumed tokens leave nothing to generate (max_tokens {max_tokens})"
        )


def resume_request(request: Request, resume: Sequence[SampledToken], limits: StopLimits) -> None:
    """Applies the tokens another engine sampled to the new request's branch, as if it had
    sampled them, and marks them (tokens and text) streamed. Raises RequestRejected when they
    would have ended the branch (the other engine would not have handed it off) or the grammar
    refuses one. Nothing to do without `resume`."""
    from cluster.engine.output_processor import apply_sampled_token

    if not resume:
        return
    branch = request.branches[0]
    for token in resume:
        try:
            finished = apply_sampled_token(request, branch, token, limits)
        except ValueError as error:
            raise RequestRejected(f"resume: {error}") from None
        if finished:
            raise RequestRejected(
                f"resume: token {token.token_id} ends the request ({branch.finish_reason}); "
                "there is nothing left to decode"
            )
    branch.text.take_delta(finished=False)
    branch.emitted_tokens = len(branch.output_token_ids)


def hand_off(request: Request, branch: Branch) -> bool:
    """After a token of a prefill-only request: ends the branch with `HANDOFF_FINISH` and
    returns True (the caller finishes it in the scheduler); False for any other request."""
    if not request.prefill_only or branch.finished:
        return False
    branch.finish_reason = HANDOFF_FINISH
    return True


def text_final(branch: Branch) -> bool:
    """Whether the branch's held-back text is flushed now: it ended, and not by a hand-off
    (the decode engine goes on from that text)."""
    return branch.finished and branch.finish_reason != HANDOFF_FINISH
