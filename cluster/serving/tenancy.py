"""Tenants: API keys map to tenants, tenants to the prefix-cache salt.

Invariants: the salt is derived on the server from the caller's API key; no request field can
choose it, so tenants never share cached blocks (except the whole blocks of an operator-declared
shared prefix); keys are compared in constant time against every configured key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field


class Unauthenticated(Exception):
    """A missing or unknown API key (HTTP 401, gRPC UNAUTHENTICATED)."""


@dataclass(frozen=True)
class Tenancy:
    """Maps API keys to tenants, and tenants to the prefix-cache salt."""

    tenants_by_key: Mapping[str, str] = field(default_factory=dict)

    def salt_for(self, authorization: str | None) -> bytes | None:
        """The tenant salt for an `Authorization: Bearer <key>` value; None when no keys are
        configured (everyone is one tenant). Raises Unauthenticated for a missing/unknown key."""
        if not self.tenants_by_key:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("an API key is required: send 'Authorization: Bearer <key>'")
        tenant = None
        for known, name in self.tenants_by_key.items():  # compare with every key: constant time
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                tenant = name
        if tenant is None:
            raise Unauthenticated("the API key is not valid")
        return hashlib.sha256(b"pagedserve.tenant\x00" + tenant.encode()).digest()
