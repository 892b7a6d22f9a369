"""The application's LoRA adapter registry: which adapters every engine replica must serve.

One named, detached Ray actor per application and `lora_modules` setting
(`lora-registry:<app>:<digest>` in namespace `pagedserve`, created by whoever needs it first,
restarted by Ray when it dies), so it outlives every replica. It starts with the configured
`lora_modules`; runtime loads and unloads (`/v1/load_lora_adapter`) change it.

```
ingress  --add / remove-->  registry (version v)  --watch (long poll)-->  each engine replica
         <--wait_applied--                         <--report(v, errors)--   applies the diff
```

Invariants:
- the registry's adapter set is the truth: every live engine replica converges to it, including
  one started later (autoscaling, a replacement after a crash), which reads it before it
  reports itself started;
- each change bumps `version`; a replica reports the version it applied and the adapters it
  could not load; `wait_applied(v)` returns once every live replica (one that watched within
  `live_after_s` and did not leave) reported v or later, or at the timeout;
- a name maps to one path: adding a name again with the same path changes nothing, with another
  path is refused (InvalidAdapter) and nothing changes;
- a restarted registry (new `epoch`) starts from the configured set; the first replica that
  still serves the old epoch's set restores it (`restore`, accepted only before any change);
- `digests` holds an adapter's weights digest only while every replica that reported it
  reported the same one (the ingress keys adapter requests' blocks with it for routing); a
  change of that map is a new version too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray

from cluster.engine.errors import AdapterNotFound, InvalidAdapter
from cluster.engine.lora_request import LoRARequest

REGISTRY_NAMESPACE = "pagedserve"
WATCH_TIMEOUT_S = 5.0
LIVE_AFTER_S = 3 * WATCH_TIMEOUT_S


@dataclass(frozen=True)
class AdapterSet:
    """A version of the registry: `adapters` in load order."""

    epoch: str
    version: int
    adapters: tuple[LoRARequest, ...]
    digests: Mapping[str, str] = field(default_factory=dict)
    """Adapter name -> weights digest, where the replicas agree (see the module doc)."""

    def get(self, name: str) -> LoRARequest | None:
        return next((a for a in self.adapters if a.lora_name == name), None)


@dataclass(frozen=True)
class ApplyReport:
    """What a replica serves after applying `version`: `errors` maps each adapter it could not
    load to why (its engine's message), `digests` each adapter it serves to its weights digest."""

    replica: str
    epoch: str
    version: int
    errors: dict[str, str] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)


class RegistryPort(Protocol):
    """The registry as its callers use it: the actor through `ActorRegistry`, or the
    `LoRARegistry` object itself in one process."""

    async def snapshot(self) -> AdapterSet: ...
    async def watch(self, replica: str | None, epoch: str | None, version: int) -> AdapterSet: ...
    async def add(self, name: str, path: str, base_model_name: str | None) -> AdapterSet: ...
    async def remove(self, name: str) -> AdapterSet: ...
    async def report(self, report: ApplyReport) -> None: ...
    async def wait_applied(self, version: int, timeout_s: float) -> list[ApplyReport]: ...
    async def restore(self, adapters: Sequence[LoRARequest]) -> bool: ...
    async def leave(self, replica: str) -> None: ...


async def wait_at_most(event: asyncio.Event, timeout_s: float) -> None:
    """Waits for `event` or `timeout_s`. `asyncio.timeout`, not `wait_for`: Python 3.11's
    `wait_for` loses a cancellation that arrives as the event fires (a watcher then never
    stops)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()


class LoRARegistry:
    """The actor body (see the module doc). Single event loop: methods interleave only at awaits."""

    def __init__(
        self,
        configured: Sequence[LoRARequest],
        watch_timeout_s: float = WATCH_TIMEOUT_S,
        live_after_s: float = LIVE_AFTER_S,
    ) -> None:
        self.epoch = uuid.uuid4().hex
        self.version = 0
        self.adapters: dict[str, LoRARequest] = {a.lora_name: a for a in configured}
        self.next_id = max((a.lora_int_id for a in configured), default=0) + 1
        self.watch_timeout_s = watch_timeout_s
        self.live_after_s = live_after_s
        self.reports: dict[str, ApplyReport] = {}
        self.seen_s: dict[str, float] = {}
        self.digests: dict[str, str] = {}
        self.changed = asyncio.Event()

    def _state(self) -> AdapterSet:
        adapters = tuple(self.adapters.values())
        return AdapterSet(self.epoch, self.version, adapters, dict(self.digests))

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def _bump(self) -> AdapterSet:
        self.version += 1
        self.digests = self._agreed_digests()
        self._notify()
        return self._state()

    def _agreed_digests(self) -> dict[str, str]:
        agreed = {}
        for name in self.adapters:
            seen = {r.digests[name] for r in self.reports.values() if name in r.digests}
            if len(seen) == 1:
                agreed[name] = seen.pop()
        return agreed

    async def snapshot(self) -> AdapterSet:
        return self._state()

    async def watch(self, replica: str | None, epoch: str | None, version: int) -> AdapterSet:
        """The current set once it differs from (`epoch`, `version`), or after the watch timeout
        (a heartbeat: `replica` stays live while it watches)."""
        if replica is not None:
            self.seen_s[replica] = time.monotonic()
        if epoch == self.epoch and version == self.version:
            waiting = self.changed
            await wait_at_most(waiting, self.watch_timeout_s)
        if replica is not None:
            self.seen_s[replica] = time.monotonic()
        return self._state()

    async def add(self, name: str, path: str, base_model_name: str | None) -> AdapterSet:
        known = self.adapters.get(name)
        if known is not None:
            if known.lora_path != path:
                raise InvalidAdapter(
                    f"The lora adapter '{name}' has already been loaded from "
                    f"'{known.lora_path}'; unload it first to load it from '{path}'"
                )
            return self._state()
        self.adapters[name] = LoRARequest(name, self.next_id, path, base_model_name)
        self.next_id += 1
        return self._bump()

    async def remove(self, name: str) -> AdapterSet:
        if self.adapters.pop(name, None) is None:
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        return self._bump()

    async def report(self, report: ApplyReport) -> None:
        self.seen_s[report.replica] = time.monotonic()
        if report.epoch == self.epoch:
            self.reports[report.replica] = report
            if self._agreed_digests() != self.digests:
                self._bump()
            else:
                self._notify()

    def _live(self) -> list[str]:
        now = time.monotonic()
        return [r for r, seen in self.seen_s.items() if now - seen <= self.live_after_s]

    async def wait_applied(self, version: int, timeout_s: float) -> list[ApplyReport]:
        """The reports of version `version` or later, once every live replica sent one (and at
        least one did), or at `timeout_s` whatever arrived by then."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = self._live()
            done = [
                self.reports[r]
                for r in live
                if r in self.reports and self.reports[r].version >= version
            ]
            left = deadline - time.monotonic()
            if (live and len(done) == len(live)) or left <= 0:
                return done
            waiting = self.changed
            await wait_at_most(waiting, min(left, 0.5))

    async def restore(self, adapters: Sequence[LoRARequest]) -> bool:
        """After a restart: take a replica's set as the truth unless anything changed since."""
        if self.version != 0:
            return False
        self.adapters = {a.lora_name: a for a in adapters}
        self.next_id = max((a.lora_int_id for a in adapters), default=0) + 1
        self._bump()
        return True

    async def leave(self, replica: str) -> None:
        self.seen_s.pop(replica, None)
        self.reports.pop(replica, None)
        self._notify()


class ActorRegistry:
    """`RegistryPort` over the registry actor's handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def snapshot(self) -> AdapterSet:
        state: AdapterSet = await self.handle.snapshot.remote()
        return state

    async def watch(self, replica: str | None, epoch: str | None, version: int) -> AdapterSet:
        state: AdapterSet = await self.handle.watch.remote(replica, epoch, version)
        return state

    async def add(self, name: str, path: str, base_model_name: str | None) -> AdapterSet:
        state: AdapterSet = await self.handle.add.remote(name, path, base_model_name)
        return state

    async def remove(self, name: str) -> AdapterSet:
        state: AdapterSet = await self.handle.remove.remote(name)
        return state

    async def report(self, report: ApplyReport) -> None:
        await self.handle.report.remote(report)

    async def wait_applied(self, version: int, timeout_s: float) -> list[ApplyReport]:
        reports: list[ApplyReport] = await self.handle.wait_applied.remote(version, timeout_s)
        return reports

    async def restore(self, adapters: Sequence[LoRARequest]) -> bool:
        restored: bool = await self.handle.restore.remote(list(adapters))
        return restored

    async def leave(self, replica: str) -> None:
        await self.handle.leave.remote(replica)


def registry_name(app_name: str, configured: Sequence[LoRARequest]) -> str:
    """Keyed by the configured modules too: a redeploy with other `lora_modules` starts afresh."""
    spelled = json.dumps([[a.lora_name, a.lora_path, a.base_model_name] for a in configured])
    return f"lora-registry:{app_name}:{hashlib.sha256(spelled.encode()).hexdigest()[:12]}"


def registry_handle(app_name: str, configured: Sequence[LoRARequest]) -> ActorRegistry:
    """The application's registry actor, created on first use (named and detached)."""
    actor = ray.remote(LoRARegistry).options(
        name=registry_name(app_name, configured),
        namespace=REGISTRY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=-1,
        num_cpus=0,
    )
    return ActorRegistry(actor.remote(list(configured)))
