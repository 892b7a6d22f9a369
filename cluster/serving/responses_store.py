"""The Responses API's store: responses kept (`store: true`, the default) so that
`GET /v1/responses/{id}`, `DELETE /v1/responses/{id}` and `previous_response_id` work.

Where it lives: in the memory of the ingress replica that answered, bounded to `max_entries`
responses (the least recently stored or read one goes first). The application runs one
ingress replica by default, so every request sees every stored response. With several ingress
replicas Serve may send a GET, DELETE or follow-up to a replica that never saw the response;
it then answers 404 (or 400 for `previous_response_id`) as for an evicted one. A response is
kept under its tenant: another API key's tenant can neither read nor continue it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_STORED_RESPONSES = 1024
"""Responses an ingress replica keeps (the oldest is dropped beyond it)."""


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: its body as the API returned it and the conversation that
    continues it (the chat messages of its input, without `instructions`, then its output)."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """Stored responses of one ingress replica, per tenant (see the module doc)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[bytes | None, str], StoredResponse] = OrderedDict()

    def put(self, tenant: bytes | None, response_id: str, stored: StoredResponse) -> None:
        key = (tenant, response_id)
        self._entries[key] = stored
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, tenant: bytes | None, response_id: str) -> StoredResponse | None:
        key = (tenant, response_id)
        stored = self._entries.get(key)
        if stored is not None:
            self._entries.move_to_end(key)
        return stored

    def delete(self, tenant: bytes | None, response_id: str) -> bool:
        return self._entries.pop((tenant, response_id), None) is not None

    def __len__(self) -> int:
        return len(self._entries)
