"""The adapter registry, each replica's sync and the ingress's service, in one process: loads and
unloads reach every replica, a replica started later serves what was loaded at run time, a bad
adapter changes nothing, and a restarted registry gets the replicas' set back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from cluster.engine.errors import AdapterNotFound, EngineDead, InvalidAdapter
from cluster.engine.lora_request import LoRARequest
from cluster.serving.lora_admin import AdapterService
from cluster.serving.lora_registry import AdapterSet, LoRARegistry
from cluster.serving.lora_sync import AdapterSync
from tests.serving.lora_fakes import BASE, FakeDeployment, FakeEngine

CONFIGURED = [LoRARequest("sql", 1, "/adapters/sql", BASE)]


def run(
    test: Callable[[FakeDeployment], Awaitable[None]],
    replicas: int = 2,
    apply_timeout_s: float = 1.5,
) -> None:
    async def body() -> None:
        deployment = FakeDeployment(CONFIGURED, replicas, apply_timeout_s)
        await deployment.start()
        await deployment.adapters.start()
        try:
            await test(deployment)
        finally:
            await deployment.stop()

    asyncio.run(asyncio.wait_for(body(), 30))


def lora(name: str, path: str) -> LoRARequest:
    return LoRARequest(name, 1, path, BASE)


def test_configured_adapters_are_served_by_every_replica_from_start() -> None:
    async def check(d: FakeDeployment) -> None:
        assert d.served() == [{"sql"}, {"sql"}]
        assert [a.lora_name for a in await d.list_loras()] == ["sql"]
        assert await d.adapters.resolve("sql") == "sql"
        assert await d.adapters.resolve(BASE) is None
        with pytest.raises(AdapterNotFound, match="`gpt-4` does not exist"):
            await d.adapters.resolve("gpt-4")

    run(check)


def test_a_runtime_load_reaches_every_replica_and_a_later_replica_too() -> None:
    async def check(d: FakeDeployment) -> None:
        await d.add_lora(lora("chat", "/adapters/chat"))
        assert d.served() == [{"sql", "chat"}] * 2  # before the call returned
        late = await d.add_replica()
        assert set(late.loras) == {"sql", "chat"}
        loads = [e.load_calls for e in d.engines]
        await d.add_lora(lora("chat", "/adapters/chat"))  # same name and path: nothing changes
        assert [e.load_calls for e in d.engines] == loads
        await d.remove_lora("chat")
        assert d.served() == [{"sql"}] * 3
        await d.remove_lora("sql")  # a configured adapter can be unloaded too
        assert d.served() == [set()] * 3
        assert set((await d.add_replica()).loras) == set()  # and stays unloaded

    run(check)


@pytest.mark.parametrize("name", ["malformed", "rank128", "wrong-shape", "missing"])
def test_a_bad_adapter_is_refused_naming_the_problem_and_nothing_else_changes(name: str) -> None:
    async def check(d: FakeDeployment) -> None:
        before = await d.registry.snapshot()
        with pytest.raises(InvalidAdapter, match=name):
            await d.add_lora(lora(name, f"/adapters/{name}"))
        assert d.served() == [{"sql"}, {"sql"}]
        assert [a.lora_name for a in (await d.registry.snapshot()).adapters] == ["sql"]
        assert (await d.registry.snapshot()).version > before.version  # added, then rolled back
        with pytest.raises(AdapterNotFound):
            await d.adapters.resolve(name)

    run(check)


def test_an_adapter_one_replica_cannot_read_is_rolled_back_on_the_others() -> None:
    async def check(d: FakeDeployment) -> None:
        await d.add_replica(unreadable={"/adapters/flaky"})
        with pytest.raises(InvalidAdapter, match="cannot read"):
            await d.add_lora(lora("flaky", "/adapters/flaky"))
        assert d.served() == [{"sql"}] * 3

    run(check)


def test_a_name_loaded_from_another_path_is_refused_and_unknown_unloads_are_not_found() -> None:
    async def check(d: FakeDeployment) -> None:
        with pytest.raises(InvalidAdapter, match="already been loaded"):
            await d.add_lora(lora("sql", "/adapters/other"))
        assert all(e.loras["sql"].lora_path == "/adapters/sql" for e in d.engines)
        with pytest.raises(AdapterNotFound, match="cannot be found"):
            await d.remove_lora("nope")
        with pytest.raises(InvalidAdapter, match="base model"):
            await d.add_lora(lora(BASE, "/adapters/x"))

    run(check)


def test_concurrent_loads_and_unloads_converge_on_every_replica() -> None:
    async def check(d: FakeDeployment) -> None:
        names = [f"a{i}" for i in range(6)]
        await asyncio.gather(*(d.add_lora(lora(n, f"/adapters/{n}")) for n in names))
        assert d.served() == [{"sql", *names}] * 2
        await asyncio.gather(*(d.remove_lora(n) for n in names[::2]))
        assert d.served() == [{"sql", *names[1::2]}] * 2

    run(check)


def test_with_no_live_replica_a_load_fails_and_is_not_kept() -> None:
    async def check(d: FakeDeployment) -> None:
        with pytest.raises(EngineDead, match="no engine replica confirmed"):
            await d.add_lora(lora("chat", "/adapters/chat"))
        assert (await d.registry.snapshot()).get("chat") is None

    run(check, replicas=0, apply_timeout_s=0.1)  # nothing can confirm: no need to wait long


def test_a_configured_adapter_that_cannot_load_fails_the_replica_start() -> None:
    async def check() -> None:
        registry = LoRARegistry([lora("bad", "/adapters/malformed")])
        sync = AdapterSync(registry, FakeEngine("r0"), "r0", [lora("bad", "/adapters/malformed")])
        with pytest.raises(InvalidAdapter, match=r"lora_modules: bad: .*not valid JSON"):
            await sync.start()

    asyncio.run(check())


def test_a_restarted_registry_gets_the_replicas_set_back() -> None:
    async def check(d: FakeDeployment) -> None:
        await d.add_lora(lora("chat", "/adapters/chat"))
        fresh = LoRARegistry(CONFIGURED, watch_timeout_s=0.2, live_after_s=2.0)
        for sync in d.syncs:
            sync.registry = fresh
        for _ in range(50):
            if (await fresh.snapshot()).get("chat") is not None:
                break
            await asyncio.sleep(0.05)
        assert [a.lora_name for a in (await fresh.snapshot()).adapters] == ["sql", "chat"]
        assert d.served() == [{"sql", "chat"}] * 2

    run(check)


def test_without_lora_only_the_base_model_resolves() -> None:
    async def check() -> None:
        service = AdapterService(BASE, None)
        assert await service.resolve(BASE) is None
        with pytest.raises(AdapterNotFound):
            await service.resolve("sql")
        with pytest.raises(InvalidAdapter, match="not enabled"):
            await service.add_lora(lora("sql", "/adapters/sql"))
        assert await service.list_loras() == []
        assert service.view == AdapterSet("", -1, ())

    asyncio.run(check())


def test_digests_are_published_where_every_replica_agrees() -> None:
    async def check(d: FakeDeployment) -> None:
        await d.add_lora(lora("chat", "/adapters/chat"))
        state = await d.registry.snapshot()
        assert dict(state.digests) == {"sql": "sha:/adapters/sql", "chat": "sha:/adapters/chat"}
        assert d.adapters.view.digests == state.digests  # the ingress's view follows
        await d.add_replica(digest_salt="-other-bytes")
        for _ in range(50):  # its report arrives with its first watch
            if not (await d.registry.snapshot()).digests:
                break
            await asyncio.sleep(0.05)
        assert dict((await d.registry.snapshot()).digests) == {}  # no agreement: no key
        await d.remove_lora("chat")
        assert "chat" not in (await d.registry.snapshot()).digests

    run(check)
