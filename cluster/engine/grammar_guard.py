"""A branch's constraint whose backend errors end only its own request.

A grammar matcher is asked for masks and drafts while the step is scheduled (`Scheduler`,
`NgramSpeculator`) and advanced while its output is applied (`append_sampled_token`). An
exception there (xgrammar refusing a state it reached, a replay that no longer matches, a
matcher bug) would otherwise leave the scheduler mid-plan and stop the step loop for every
request. `GuardedConstraint` wraps a branch's `TokenConstraint` so that it never raises while a
step is planned:

- the first error is recorded; from then on the branch is not synced, asks for no mask
  (`bitmasks` gives None: its row samples freely) and drafts nothing (`valid_drafts` gives 0),
  so the plan is built as for an unconstrained branch;
- the next token applied to it (`accept`, right after the step that sampled it) raises
  `GrammarFailed` with the backend's message; the engine's per-request path for a token it
  cannot apply (`EngineCore.advance_step`) then fails that request alone, its sampled token
  dropped, while every other request of the step goes on.

Invariant: once `error` is set it stays set, and every later `accept` raises it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from cluster.engine.reasoning import TokenConstraint

log = logging.getLogger(__name__)


class GrammarFailed(RuntimeError):
    """The constraint's backend failed on this request; the message says how."""


class GuardedConstraint:
    """`inner`, its errors recorded instead of raised while a step is planned (see the module
    doc). A `TokenConstraint` itself."""

    def __init__(self, inner: TokenConstraint) -> None:
        self.inner = inner
        self.error: str | None = None
        """The first backend error, as the client reads it (None: healthy)."""

    @property
    def is_terminated(self) -> bool:
        if self.error is not None:
            return False
        try:
            return self.inner.is_terminated
        except Exception as error:
            self._record("is_terminated", error)
            return False

    def accept(self, token_id: int) -> bool:
        self._raise_recorded()
        try:
            return self.inner.accept(token_id)
        except Exception as error:
            raise self._record("accept", error) from error

    def sync(self, output_token_ids: Sequence[int]) -> None:
        if self.error is not None:
            return
        try:
            self.inner.sync(output_token_ids)
        except Exception as error:
            self._record("sync", error)

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        if self.error is not None:
            return 0
        try:
            return self.inner.valid_drafts(drafts)
        except Exception as error:
            self._record("valid_drafts", error)
            return 0

    def bitmasks(self, drafts: Sequence[int] = ()) -> torch.Tensor | None:
        if self.error is not None:
            return None
        try:
            return self.inner.bitmasks(drafts)
        except Exception as error:
            self._record("bitmasks", error)
            return None

    def _record(self, operation: str, error: Exception) -> GrammarFailed:
        """Keeps the first error; the failure to raise where a token is applied."""
        if self.error is None:
            log.warning("grammar matcher failed in %s", operation, exc_info=error)
            self.error = (
                f"structured outputs: the grammar matcher failed on this request "
                f"({type(error).__name__}: {error})"
            )
        return GrammarFailed(self.error)

    def _raise_recorded(self) -> None:
        if self.error is not None:
            raise GrammarFailed(self.error)
