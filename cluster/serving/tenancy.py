"""Tenants: API keys map to tenants, tenants to the prefix-cache salt; some keys are admins'.

Invariants: the salt is derived on the server from the caller's API key; no request field can
choose it, so tenants never share cached blocks (except the whole blocks of an operator-declared
shared prefix); keys are compared in constant time against every configured key; only a key
marked admin passes `authorize_admin` (with no keys configured there is no authentication, and
everyone passes).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field


class Unauthenticated(Exception):
    """A missing or unknown API key (HTTP 401, gRPC UNAUTHENTICATED)."""


class Forbidden(Exception):
    """A valid API key that may not do this (HTTP 403, gRPC PERMISSION_DENIED)."""


@dataclass(frozen=True)
class Tenancy:
    """Maps API keys to tenants, and tenants to the prefix-cache salt; `admin_keys` (a subset of
    the keys) may administer the server (load and unload LoRA adapters)."""

    tenants_by_key: Mapping[str, str] = field(default_factory=dict)
    admin_keys: frozenset[str] = frozenset()

    def salt_for(self, authorization: str | None) -> bytes | None:
        """The tenant salt for an `Authorization: Bearer <key>` value; None when no keys are
        configured (everyone is one tenant). Raises Unauthenticated for a missing/unknown key."""
        if not self.tenants_by_key:
            return None
        tenant = self.tenants_by_key[self._known_key(authorization)]
        return hashlib.sha256(b"pagedserve.tenant\x00" + tenant.encode()).digest()

    def authorize_admin(self, authorization: str | None) -> None:
        """Passes for an admin key (or when no keys are configured). Raises Unauthenticated for a
        missing or unknown key, Forbidden for a valid key that is not an admin's."""
        if not self.tenants_by_key:
            return
        key = self._known_key(authorization)
        if key not in self.admin_keys:
            raise Forbidden("this API key may not load or unload adapters (admin keys only)")

    def _known_key(self, authorization: str | None) -> str:
        """The configured key the header carries; Unauthenticated when it carries none."""
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise Unauthenticated("an API key is required: send 'Authorization: Bearer <key>'")
        found = None
        for known in self.tenants_by_key:  # compare with every key: constant time
            if hmac.compare_digest(known.encode(), given.strip().encode()):
                found = known
        if found is None:
            raise Unauthenticated("the API key is not valid")
        return found
