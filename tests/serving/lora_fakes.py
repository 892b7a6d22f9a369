"""In-process doubles for the LoRA serving tests without Ray: engines that accept or refuse
adapters by path (as the engine half's checks would), and a deployment of them that follows
the real `LoRARegistry` through the real `AdapterSync`, with the real `AdapterService` on top."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from cluster.engine.errors import AdapterNotFound, InvalidAdapter
from cluster.engine.generate_request import GenerateRequest
from cluster.engine.lora_request import LoRARequest
from cluster.engine.output_stream import BranchDelta, RequestDelta
from cluster.engine.outputs import RequestMetrics
from cluster.serving.lora_admin import AdapterService
from cluster.serving.lora_registry import LoRARegistry
from cluster.serving.lora_sync import AdapterSync

BASE = "tiny"
PROBLEMS = {
    "malformed": "adapter_config.json is not valid JSON",
    "rank128": "rank 128 is above lora.max_lora_rank (64)",
    "wrong-shape": "q_proj.lora_B has shape [32, 8], the base model needs [64, 8]",
    "missing": "no adapter_config.json in the directory",
}
"""A path ending in one of these names is refused with that problem."""


def problem_of(path: str) -> str | None:
    return PROBLEMS.get(path.rstrip("/").rsplit("/", 1)[-1])


@dataclass
class FakeEngine:
    """One replica's engine: the LoRA half of `EngineClient` with the contract's rules, and a
    `generate` that answers with the adapter it ran under. `unreadable` paths fail here only."""

    name: str
    unreadable: set[str] = field(default_factory=set)
    digest_salt: str = ""
    """Changes every digest this engine reports (a replica that read other bytes)."""
    forgotten: set[str] = field(default_factory=set)
    """Adapters `generate` refuses as unknown (as if unloaded just before admission)."""
    loras: dict[str, LoRARequest] = field(default_factory=dict)
    requests: list[GenerateRequest] = field(default_factory=list)
    load_calls: int = 0

    async def add_lora(self, lora: LoRARequest) -> None:
        known = self.loras.get(lora.lora_name)
        if known is not None and known.lora_path == lora.lora_path:
            return
        self.load_calls += 1
        problem = problem_of(lora.lora_path)
        if lora.lora_path in self.unreadable:
            problem = "cannot read the adapter's files"
        if problem is not None:
            raise InvalidAdapter(f"adapter {lora.lora_name!r} ({lora.lora_path}): {problem}")
        self.loras[lora.lora_name] = lora

    async def remove_lora(self, lora_name: str) -> None:
        if self.loras.pop(lora_name, None) is None:
            raise AdapterNotFound(f"adapter {lora_name!r} is not loaded")

    async def list_loras(self) -> list[LoRARequest]:
        return list(self.loras.values())

    def digests(self) -> dict[str, str]:
        """Name -> weights digest, as `RequestKeys.adapters` holds them: by path here."""
        return {name: f"sha:{a.lora_path}{self.digest_salt}" for name, a in self.loras.items()}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        known = set(self.loras) - self.forgotten
        if request.adapter is not None and request.adapter not in known:
            raise AdapterNotFound(f"The model `{request.adapter}` does not exist.")
        self.requests.append(request)
        text = f"[{request.adapter or BASE}]"
        yield RequestDelta(
            request_id=request.request_id or "r",
            branches=[BranchDelta(0, text, [1], finish_reason="stop")],
            finished=True,
            num_cached_tokens=0,
            prompt_token_ids=list(request.token_ids),
            metrics=RequestMetrics(arrival_time=time.time()),
            served_by=self.name,
        )


class FakeDeployment:
    """Engine replicas following one registry; `client` is the ingress's `EngineClient` over
    them (round-robin generation, adapters through the registry)."""

    def __init__(
        self,
        configured: Sequence[LoRARequest] = (),
        replicas: int = 2,
        apply_timeout_s: float = 1.5,
    ) -> None:
        self.configured = list(configured)
        self.registry = LoRARegistry(self.configured, watch_timeout_s=0.2, live_after_s=2.0)
        self.engines: list[FakeEngine] = []
        self.syncs: list[AdapterSync] = []
        self.adapters = AdapterService(BASE, self.registry, apply_timeout_s=apply_timeout_s)
        self._next = itertools.count()
        self._replicas = replicas

    async def start(self) -> None:
        for _ in range(self._replicas):
            await self.add_replica()

    async def add_replica(
        self, unreadable: set[str] | None = None, digest_salt: str = ""
    ) -> FakeEngine:
        engine = FakeEngine(f"r{len(self.engines)}", unreadable or set(), digest_salt)
        sync = AdapterSync(self.registry, engine, engine.name, self.configured, engine.digests)
        await sync.start()
        self.engines.append(engine)
        self.syncs.append(sync)
        return engine

    async def stop(self) -> None:
        for sync in self.syncs:
            await sync.close()
        await self.adapters.close()

    def served(self) -> list[set[str]]:
        return [set(engine.loras) for engine in self.engines]

    # --- EngineClient ----------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        return self.engines[next(self._next) % len(self.engines)].generate(request)

    async def abort(self, request_id: str) -> None:
        return None

    async def add_lora(self, lora: LoRARequest) -> None:
        await self.adapters.add_lora(lora)

    async def remove_lora(self, lora_name: str) -> None:
        await self.adapters.remove_lora(lora_name)

    async def list_loras(self) -> list[LoRARequest]:
        return await self.adapters.list_loras()
