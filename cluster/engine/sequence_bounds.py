"""`RequestBounds`: the most tokens each live sequence may hold, read from the engine's requests.

A KV layout that reserves memory by length (`kv_layouts`' contiguous one) asks it when it admits
a sequence; the paged layout never does. The engine keeps no state for it: a sequence's bound is
its request's prompt plus `max_tokens`, and it is looked up in the requests the engine holds
(a scan, done once per admitted sequence).
"""

from __future__ import annotations

from collections.abc import Mapping

from cluster.engine.request import Request


class RequestBounds:
    """`kv_layouts.SequenceBounds` over the engine's live requests (request id -> request)."""

    def __init__(self, requests: Mapping[str, Request]) -> None:
        self._requests = requests

    def max_tokens(self, seq_id: int) -> int | None:
        """Prompt + max_tokens of the request `seq_id` is a branch of; None when no live
        request has it."""
        for request in self._requests.values():
            if any(branch.seq_id == seq_id for branch in request.branches):
                return len(request.prompt_token_ids) + request.max_tokens
        return None
