"""`AdapterService`: the ingress's view of the application's LoRA adapters, and runtime loading.

It resolves a request's `model` to an adapter (HTTP `"model"`, gRPC `model`/`adapter`), lists
the adapters for `/v1/models`, and loads and unloads them at run time through the registry
(cluster/serving/lora_registry.py), which every engine replica follows. It is also the LoRA
half of the ingress's `EngineClient` (`add_lora`, `remove_lora`, `list_loras`), for the whole
deployment rather than one replica.

Invariants:
- `resolve` answers None for the base model, the adapter's name for an adapter the registry
  holds (checking the registry again before refusing a name its cached view lacks), and raises
  AdapterNotFound (404 `model_not_found` / NOT_FOUND) for anything else; with LoRA off only
  the base model resolves;
- a load returns only after every live engine replica applied it (or the timeout passed with
  at least one that did); if any replica could not load the adapter it is removed again and
  the load fails with InvalidAdapter naming the problem: nothing already loaded is affected;
- an unload of a name the registry does not hold raises AdapterNotFound; requests running with
  an unloaded adapter finish, later ones get 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from cluster.engine.background import cancel_and_wait
from cluster.engine.errors import AdapterNotFound, EngineDead, InvalidAdapter
from cluster.engine.lora_request import LoRARequest
from cluster.serving.lora_registry import AdapterSet, RegistryPort

log = logging.getLogger(__name__)

APPLY_TIMEOUT_S = 60.0
"""How long a load or unload waits for the engine replicas (a load reads and checks files)."""


def unknown_model(model: str) -> AdapterNotFound:
    return AdapterNotFound(f"The model `{model}` does not exist.")


class AdapterService:
    """See the module doc. `registry` None: LoRA is off and only `base_model` is served."""

    def __init__(
        self,
        base_model: str,
        registry: RegistryPort | None,
        apply_timeout_s: float = APPLY_TIMEOUT_S,
    ) -> None:
        self.base_model = base_model
        self.registry = registry
        self.apply_timeout_s = apply_timeout_s
        self.view = AdapterSet("", -1, ())
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.registry is not None

    async def start(self) -> None:
        """Reads the registry and keeps the cached view fresh (a long poll)."""
        if self.registry is None:
            return
        with contextlib.suppress(Exception):
            self._see(await self.registry.snapshot())
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    def _see(self, state: AdapterSet) -> None:
        if state.epoch != self.view.epoch or state.version >= self.view.version:
            self.view = state

    async def _watch(self) -> None:
        assert self.registry is not None
        while True:
            try:
                self._see(await self.registry.watch(None, self.view.epoch, self.view.version))
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.debug("LoRA registry watch failed at the ingress: %r", error)
                await asyncio.sleep(1.0)

    def known(self, model: str) -> bool:
        """Whether `model` names the base model or an adapter in the cached view."""
        return model == self.base_model or self.view.get(model) is not None

    async def resolve(self, model: str) -> str | None:
        """None for the base model, else the adapter's name; raises AdapterNotFound."""
        if model == self.base_model:
            return None
        if self.view.get(model) is not None:
            return model
        if self.registry is not None:
            with contextlib.suppress(Exception):
                self._see(await self.registry.snapshot())
            if self.view.get(model) is not None:
                return model
        raise unknown_model(model)

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters served now, in load order (the registry's, else the cached view's)."""
        if self.registry is not None:
            with contextlib.suppress(Exception):
                self._see(await self.registry.snapshot())
        return list(self.view.adapters)

    def _registry(self) -> RegistryPort:
        if self.registry is None:
            raise InvalidAdapter("LoRA is not enabled on this server")
        return self.registry

    async def add_lora(self, lora: LoRARequest) -> None:
        """Loads `lora` on every engine replica (see the invariants); same name and path again is
        a no-op. Raises InvalidAdapter, or EngineDead when no replica confirmed it in time."""
        registry = self._registry()
        if lora.lora_name == self.base_model:
            raise InvalidAdapter(f"'{lora.lora_name}' is the base model's name")
        state = await registry.add(lora.lora_name, lora.lora_path, lora.base_model_name)
        self._see(state)
        reports = await registry.wait_applied(state.version, self.apply_timeout_s)
        failures = [r.errors[lora.lora_name] for r in reports if lora.lora_name in r.errors]
        if failures or not reports:
            with contextlib.suppress(AdapterNotFound):  # a concurrent load's rollback won
                rolled_back = await registry.remove(lora.lora_name)
                self._see(rolled_back)
                await registry.wait_applied(rolled_back.version, self.apply_timeout_s)
            if failures:
                raise InvalidAdapter(failures[0])
            raise EngineDead(
                f"no engine replica confirmed loading '{lora.lora_name}' within "
                f"{self.apply_timeout_s:g} s"
            )

    async def remove_lora(self, lora_name: str) -> None:
        """Unloads the adapter on every engine replica. Raises AdapterNotFound."""
        registry = self._registry()
        state = await registry.remove(lora_name)
        self._see(state)
        await registry.wait_applied(state.version, self.apply_timeout_s)
