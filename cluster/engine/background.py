"""Stopping a background asyncio task: the one rule every long-lived watcher and loop follows."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancels `task` (None: nothing runs) and waits until it has ended, so nothing it does
    outlives the caller's close; its cancellation is swallowed, any other error it raised while
    ending propagates."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
