"""A tensor-parallel degree the model cannot split is refused when the config is loaded, naming
the field and the head counts; a replica whose constructor failed stops cleanly."""

from __future__ import annotations

import asyncio

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.errors import ConfigError
from cluster.serving.engine_server import GenerationServer
from cluster.serving.serve_app import build_app


def test_tp2_of_the_default_model_is_refused_at_config_load() -> None:
    config = EngineConfig.build({"parallel": {"tensor_parallel_size": 2}})
    with pytest.raises(ConfigError) as refused:
        config.check_model()
    message = str(refused.value)
    assert "parallel.tensor_parallel_size" in message
    assert "9 attention heads" in message and "3 KV heads" in message
    assert "one of [1, 3]" in message


def test_build_app_refuses_it_before_any_replica_starts() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel_size.*9 attention heads"):
        build_app({"engine": {"parallel": {"tensor_parallel_size": 2}}})


def test_a_splittable_degree_passes() -> None:
    EngineConfig.build({"parallel": {"tensor_parallel_size": 3}}).check_model()


def test_del_after_a_failed_constructor_does_not_raise() -> None:
    server_class = GenerationServer.func_or_class
    server = object.__new__(server_class)  # as Serve finds it when __init__ raised
    asyncio.run(server.__del__())
