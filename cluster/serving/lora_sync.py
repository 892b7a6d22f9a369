"""`AdapterSync`: keeps one engine replica's LoRA adapters equal to the application's registry.

At start the replica reads the registry and loads its set (the configured `lora_modules` plus
whatever was loaded at run time) before it takes traffic; then it watches the registry (a long
poll) and applies each new version: it removes what the registry no longer holds (or holds under
another path) and loads what it lacks, then reports the version with the adapters that failed.

Invariants:
- the replica's adapters converge to the registry's set, version after version; a failed load
  leaves the others untouched (the engine's contract) and is reported, never retried in a loop;
- a configured adapter that cannot be loaded fails the replica's start (a configuration error,
  named in the message); a runtime one only fails its own load request;
- when the registry cannot be reached at start the replica serves the configured set and keeps
  trying; a restarted registry (new epoch) is given back this replica's set (`restore`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from cluster.engine.background import cancel_and_wait
from cluster.engine.errors import AdapterNotFound, InvalidAdapter, RequestRejected
from cluster.engine.lora_request import LoRARequest
from cluster.serving.lora_registry import AdapterSet, ApplyReport, RegistryPort

log = logging.getLogger(__name__)

RETRY_S = 1.0


class AdapterEngine(Protocol):
    """The LoRA half of `EngineClient`."""

    async def add_lora(self, lora: LoRARequest) -> None: ...
    async def remove_lora(self, lora_name: str) -> None: ...
    async def list_loras(self) -> list[LoRARequest]: ...


class AdapterSync:
    """One replica's side of the registry (see the module doc)."""

    def __init__(
        self,
        registry: RegistryPort,
        engine: AdapterEngine,
        replica: str,
        configured: Sequence[LoRARequest],
        digests: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        """`digests`: the engine's adapter name -> weights digest map (reported with each
        version, so the ingress can key adapter requests for routing)."""
        self.registry = registry
        self.digests = digests
        self.engine = engine
        self.replica = replica
        self.configured = tuple(configured)
        self.epoch: str | None = None
        self.version = -1
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Loads the registry's set (or the configured one when the registry is unreachable),
        then watches it. Raises InvalidAdapter naming a configured adapter that cannot load."""
        try:
            state = await self.registry.snapshot()
        except Exception as error:  # the registry is down: serve the configuration for now
            log.warning("LoRA registry unreachable at start (%r); loading lora_modules", error)
            state = AdapterSet("", -1, self.configured)
        report = await self.apply(state)
        configured = {a.lora_name for a in self.configured}
        failed = {name: why for name, why in report.errors.items() if name in configured}
        if failed:
            raise InvalidAdapter(
                "lora_modules: " + "; ".join(f"{name}: {why}" for name, why in failed.items())
            )
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def apply(self, state: AdapterSet) -> ApplyReport:
        """Makes the engine serve exactly `state.adapters`; reports it to the registry."""
        wanted = {a.lora_name: a for a in state.adapters}
        errors: dict[str, str] = {}
        for served in await self.engine.list_loras():
            target = wanted.get(served.lora_name)
            if target is None or target.lora_path != served.lora_path:
                with contextlib.suppress(AdapterNotFound):
                    await self.engine.remove_lora(served.lora_name)
        for adapter in state.adapters:
            try:
                await self.engine.add_lora(adapter)  # a no-op when already served
            except RequestRejected as error:  # InvalidAdapter, or LoRA off in the engine
                errors[adapter.lora_name] = str(error)
                log.warning("replica %s cannot load adapter %r: %s", self.replica, adapter, error)
        self.epoch, self.version = state.epoch, state.version
        digests = {
            name: digest
            for name, digest in (self.digests() if self.digests is not None else {}).items()
            if name in wanted and name not in errors
        }
        report = ApplyReport(self.replica, state.epoch, state.version, errors, digests)
        if state.version >= 0:
            with contextlib.suppress(Exception):
                await self.registry.report(report)
        return report

    async def _run(self) -> None:
        while True:
            try:
                state = await self.registry.watch(self.replica, self.epoch, self.version)
                restarted = self.epoch and state.epoch != self.epoch and state.version == 0
                # A registry restarted from the configuration is given back this replica's set.
                if restarted and await self.registry.restore(await self.engine.list_loras()):
                    state = await self.registry.snapshot()
                if (state.epoch, state.version) != (self.epoch, self.version):
                    await self.apply(state)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.debug("LoRA registry watch failed on %s: %r", self.replica, error)
                await asyncio.sleep(RETRY_S)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self.registry.leave(self.replica)
