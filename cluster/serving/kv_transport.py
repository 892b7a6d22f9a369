"""`ServeKVTransport`: the Ray transport of KV pulls between engine replicas of one app.

The receiver calls the holder replica's `export_kv` through its deployment's handle (its own
engine deployment's, or the one a `KVSourceHint` names), naming the holder (`target_replica`,
which `PrefixAwareRouter` honours); the answer (a `KVPayload`: per-rank shards as numpy arrays)
comes back through Ray's object store. A call that Serve cannot place on the holder lands on
another replica, which answers with the blocks it holds under exactly those keys (possibly
none): never the wrong KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cluster.kv_transfer.payload import KVPayload, PullFailure, TransferError
from cluster.serving.routing import TARGET_REPLICA_KWARG

EXPORT_METHOD = "export_kv"


class ServeKVTransport:
    """Pulls from replicas of the application `app_name`: of `deployment` (the receiver's own
    engine deployment) unless a fetch names another one (a hint from a prefill deployment)."""

    def __init__(self, app_name: str, deployment: str) -> None:
        self.app_name = app_name
        self.deployment = deployment
        self._handles: dict[str, Any] = {}

    def _handle(self, deployment: str) -> Any:
        handle = self._handles.get(deployment)
        if handle is None:
            from ray import serve

            handle = serve.get_deployment_handle(deployment, self.app_name)
            handle = self._handles[deployment] = handle.options(method_name=EXPORT_METHOD)
        return handle

    async def fetch(
        self, holder: str, block_keys: Sequence[bytes], *, deployment: str | None = None
    ) -> KVPayload:
        try:
            handle = self._handle(deployment or self.deployment)
            payload = await handle.remote(list(block_keys), **{TARGET_REPLICA_KWARG: holder})
        except Exception as error:  # a dead or failing holder: the receiver computes
            raise TransferError(
                f"pull from replica {holder!r} failed: {error!r}", PullFailure.HOLDER_FAILED
            ) from error
        if not isinstance(payload, KVPayload):
            raise TransferError(
                f"replica {holder!r} answered {type(payload)}", PullFailure.MISMATCH
            )
        return payload
