"""Applies one sampled token to a branch in two parts: what the next schedule needs, and its text.

`append_sampled_token` is the part the next step's plan depends on: a constrained branch's
grammar accepts the token first (a token it refuses is an error: the mask rank 0 applied allows
none), the token joins `token_ids`, and the checks that need no text end the branch: EOS (unless
`ignore_eos`) or a stop token id (once `min_tokens` tokens are out), the grammar terminated,
`max_tokens`, the model's context length. `apply_token_text` is the rest (log-probability,
detokenization, stop strings); with async scheduling it runs while the next step executes, so
a stop string can only end a branch one step late (`EngineCore.settle_step` drops the token
computed meanwhile).

Together, in that order, they decide exactly what one pass decides with these precedences: EOS /
stop token id, then a stop string in the text, then the grammar terminated (finish_reason
"stop"), then `max_tokens` and the model's length ("length", or "stop" when the text flushed at
the end holds a stop string). The finishing token stays in `token_ids`; EOS and stop tokens are
special and left out of the text by the decoder, a stop string is cut from the text unless
`include_stop_str_in_output`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cluster.engine.outputs import Logprob
from cluster.engine.request import Branch, Request
from workers.plan import SampledToken


@dataclass(frozen=True)
class StopLimits:
    eos_token_ids: frozenset[int]
    max_model_len: int


class TokenEnd(enum.Enum):
    """Why `append_sampled_token` ended a branch (before its text was looked at)."""

    STOP_TOKEN = "stop_token"
    GRAMMAR = "grammar"
    LENGTH = "length"


def apply_sampled_token(
    request: Request, branch: Branch, sampled: SampledToken, limits: StopLimits
) -> bool:
    """Both parts at once; returns True when the branch is now finished."""
    end = append_sampled_token(request, branch, sampled, limits)
    apply_token_text(request, branch, sampled, end)
    return branch.finished


def append_sampled_token(
    request: Request, branch: Branch, sampled: SampledToken, limits: StopLimits
) -> TokenEnd | None:
    """Appends the token; what ended the branch without looking at its text (None: running)."""
    token = sampled.token_id
    grammar = branch.grammar
    if grammar is not None:
        grammar.sync(branch.output_token_ids)
        if not grammar.accept(token):
            raise ValueError(f"token {token} was sampled but the request's grammar forbids it")
    branch.token_ids.append(token)
    branch.output_token_ids.append(token)
    params = request.params
    is_stop_id = token in params.stop_token_ids
    stoppable = len(branch.output_token_ids) >= params.min_tokens
    if stoppable and (is_stop_id or (not params.ignore_eos and token in limits.eos_token_ids)):
        branch.finish_reason = "stop"
        branch.stop_reason = token if is_stop_id else None
        return TokenEnd.STOP_TOKEN
    if grammar is not None and grammar.is_terminated:
        branch.finish_reason = "stop"
        return TokenEnd.GRAMMAR
    if len(branch.output_token_ids) >= request.max_tokens or (
        len(branch.token_ids) >= limits.max_model_len
    ):
        branch.finish_reason = "length"
        return TokenEnd.LENGTH
    return None


def apply_token_text(
    request: Request, branch: Branch, sampled: SampledToken, end: TokenEnd | None
) -> bool:
    """The token's log-probability and text, `end` being what `append_sampled_token` said;
    True when a stop string ended a branch that was still running (the caller finishes it)."""
    if request.params.logprobs is not None:
        _record_logprob(branch, sampled)
    token = sampled.token_id
    if end is TokenEnd.STOP_TOKEN:
        branch.text.add_token(token)
        branch.text.finish()
        return False
    match = branch.text.add_token(token)
    if match is None and end is None:  # the decode step's common case
        return False
    if match is not None:
        branch.finish_reason = "stop"
        branch.stop_reason = match.stop
        return end is None
    if end is TokenEnd.GRAMMAR:
        branch.text.finish()
    elif end is TokenEnd.LENGTH:
        match = branch.text.finish()
        if match is not None:
            branch.finish_reason = "stop"
            branch.stop_reason = match.stop
    return False


def _record_logprob(branch: Branch, sampled: SampledToken) -> None:
    """The request asked for log-probabilities: the token's go with the branch."""
    if branch.logprobs is None:
        branch.logprobs = []
    top = dict(sampled.top_logprobs or ())
    branch.logprobs.append(Logprob(token_id=sampled.token_id, logprob=sampled.logprob, top=top))
    if sampled.logprob is not None:
        branch.cumulative_logprob = (branch.cumulative_logprob or 0.0) + sampled.logprob
