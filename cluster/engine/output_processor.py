"""Applies one sampled token to a branch: tokens, logprobs, text, and the stop conditions.

A constrained branch's grammar accepts the token first (a token it refuses is an error: the mask
rank 0 applied allows none); then, in order, the first check that holds ends the branch: EOS
(unless `ignore_eos`), a stop token id, a stop string in the text, the grammar terminated
(finish_reason "stop"), `max_tokens`, the model's context length. The finishing token
stays in `token_ids`; EOS and stop tokens are special and left out of the text by the decoder,
a stop string is cut from the text unless `include_stop_str_in_output`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from cluster.engine.outputs import Logprob
from cluster.engine.request import Branch, Request
from workers.plan import SampledToken


@dataclass(frozen=True)
class StopLimits:
    eos_token_ids: frozenset[int]
    max_model_len: int


def apply_sampled_token(
    request: Request, branch: Branch, sampled: SampledToken, limits: StopLimits
) -> bool:
    """Appends the token and returns True when the branch is now finished."""
    token = sampled.token_id
    grammar = branch.grammar
    if grammar is not None:
        grammar.sync(branch.output_token_ids)
        if not grammar.accept(token):
            raise ValueError(f"token {token} was sampled but the request's grammar forbids it")
    branch.token_ids.append(token)
    branch.output_token_ids.append(token)
    _record_logprob(request, branch, sampled)
    params = request.params
    if token in _stop_ids(params.stop_token_ids, limits.eos_token_ids, params.ignore_eos):
        branch.text.add_tokens([token])
        branch.text.finish()
        branch.finish_reason = "stop"
        branch.stop_reason = token if token in params.stop_token_ids else None
        return True
    match = branch.text.add_tokens([token])
    if match is not None:
        branch.finish_reason = "stop"
        branch.stop_reason = match.stop
        return True
    if grammar is not None and grammar.is_terminated:
        branch.text.finish()
        branch.finish_reason = "stop"
        return True
    if len(branch.output_token_ids) >= request.max_tokens or (
        len(branch.token_ids) >= limits.max_model_len
    ):
        match = branch.text.finish()
        branch.finish_reason = "stop" if match is not None else "length"
        branch.stop_reason = match.stop if match is not None else None
        return True
    return False


def _stop_ids(
    stop_token_ids: Collection[int], eos_token_ids: frozenset[int], ignore_eos: bool
) -> frozenset[int]:
    if ignore_eos:
        return frozenset(stop_token_ids)
    return eos_token_ids.union(stop_token_ids)


def _record_logprob(request: Request, branch: Branch, sampled: SampledToken) -> None:
    if request.params.logprobs is None:
        return
    if branch.logprobs is None:
        branch.logprobs = []
    top = dict(sampled.top_logprobs or ())
    branch.logprobs.append(Logprob(token_id=sampled.token_id, logprob=sampled.logprob, top=top))
    if sampled.logprob is not None:
        branch.cumulative_logprob = (branch.cumulative_logprob or 0.0) + sampled.logprob
