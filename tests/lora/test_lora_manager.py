"""The engine's adapter bookkeeping alone (no model): names vs weights, slots, the CPU LRU."""

from __future__ import annotations

import pytest

from cluster.engine.config import LoRASettings
from cluster.engine.errors import AdapterNotFound, InvalidAdapter
from cluster.engine.lora_manager import LoRAManager
from cluster.engine.lora_request import LoRARequest
from workers.lora import AdapterSummary


def _summary(digest: str) -> AdapterSummary:
    return AdapterSummary(digest, 8, 2.0, ("q_proj",), 1024)


def _manager(max_loras: int = 2, max_cpu_loras: int | None = None) -> LoRAManager:
    settings = LoRASettings(enable_lora=True, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    return LoRAManager(settings)


def test_names_share_weights_and_slots() -> None:
    manager = _manager()
    manager.register(LoRARequest("a", 1, "p/a"), _summary("d1"))
    manager.register(LoRARequest("a-copy", 2, "p/copy"), _summary("d1"))
    assert manager.resolve("a") == manager.resolve("a-copy") == "d1"
    placed, loads = manager.assign({"d1"})
    assert placed == {"d1": 0} and [(x.slot, x.digest) for x in loads] == [(0, "d1")]
    assert manager.assign({"d1"})[1] == []  # still in its slot: nothing to load
    with pytest.raises(InvalidAdapter, match="already loaded from 'p/a'"):
        manager.check_new(LoRARequest("a", 1, "p/other"))
    manager.remove("a")
    assert manager.resolve("a-copy") == "d1"  # the weights stay for the other name
    with pytest.raises(AdapterNotFound):
        manager.resolve("a")


def test_slots_evict_the_least_recently_used_outside_the_step() -> None:
    manager = _manager(max_loras=2, max_cpu_loras=4)
    for index, digest in enumerate(("d1", "d2", "d3")):
        manager.register(LoRARequest(f"n{index}", index + 1, f"p{index}"), _summary(digest))
    manager.assign({"d1"})
    manager.assign({"d2"})
    manager.assign({"d1"})  # d2 is now the least recently used slot
    placed, loads = manager.assign({"d1", "d3"})
    assert placed == {"d1": 0, "d3": 1} and [x.slot for x in loads] == [1]
    assert manager.counters.loads == 3 and manager.counters.evictions == 1
    with pytest.raises(RuntimeError, match="exceed max_loras"):
        manager.assign({"d1", "d2", "d3"})


def test_cpu_lru_and_forgetting_after_the_last_request() -> None:
    manager = _manager(max_loras=1, max_cpu_loras=1)
    manager.register(LoRARequest("a", 1, "pa"), _summary("d1"))
    manager.hold("d1")  # a request is running with it
    manager.register(LoRARequest("b", 2, "pb"), _summary("d2"))
    assert manager.take_drops() == ["d1"] and list(manager.cpu) == ["d2"]
    manager.remove("a")
    assert "d1" in manager.weights  # held by its request
    manager.release("d1")
    assert "d1" not in manager.weights and manager.take_drops() == []
    manager.remove("b")
    assert manager.take_drops() == ["d2"] and manager.weights == {}


def test_a_registration_that_lost_a_race_drops_the_weights_it_loaded() -> None:
    """Two `add`s of one name load concurrently (off the engine's thread); the second to
    register loses. Weights only it loaded leave the ranks with the next plan; weights a served
    name uses stay."""
    manager = _manager()
    manager.register(LoRARequest("a", 1, "p/a"), _summary("d1"))
    with pytest.raises(InvalidAdapter, match="already loaded"):
        manager.register(LoRARequest("a", 1, "p/other"), _summary("d2"))
    assert manager.take_drops() == ["d2"] and manager.resolve("a") == "d1"
    manager.register(LoRARequest("a", 1, "p/a"), _summary("d1"))  # same path: a no-op
    assert manager.take_drops() == []
    manager.register(LoRARequest("a", 1, "p/a"), _summary("d3"))  # the file changed meanwhile
    assert manager.take_drops() == ["d3"] and manager.resolve("a") == "d1"
    manager.register(LoRARequest("b", 2, "p/b"), _summary("d1"))
    with pytest.raises(InvalidAdapter):
        manager.register(LoRARequest("b", 2, "p/c"), _summary("d1"))  # d1 is served
    assert manager.take_drops() == []
