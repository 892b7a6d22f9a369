"""The Serve app's arguments and tenancy, without a cluster: validation names the bad field, and the
tenant salt depends on the key's tenant only."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.engine.errors import ConfigError
from cluster.serving.app_args import ServeAppArgs
from cluster.serving.serve_app import build_app
from cluster.serving.tenancy import Tenancy, Unauthenticated

KEYS = {"k1": "alice", "k2": "alice", "k3": "bob"}


def test_salt_is_per_tenant_not_per_key() -> None:
    tenancy = Tenancy(KEYS)
    alice_1 = tenancy.salt_for("Bearer k1")
    assert alice_1 == tenancy.salt_for("bearer k2")
    assert alice_1 != tenancy.salt_for("Bearer k3")
    assert alice_1 is not None and len(alice_1) == 32


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer  ", "Basic k1", "Bearer k4", "k1"])
def test_missing_or_unknown_keys_are_refused(header: str | None) -> None:
    with pytest.raises(Unauthenticated):
        Tenancy(KEYS).salt_for(header)


def test_without_keys_everyone_is_one_tenant_with_no_salt() -> None:
    assert Tenancy().salt_for(None) is None
    assert Tenancy().salt_for("Bearer anything") is None


def test_build_app_rejects_a_bad_engine_section_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"cache\.block_size"):
        build_app({"engine": {"cache": {"block_size": 3}}})
    with pytest.raises(ValidationError, match="unknown_option"):
        ServeAppArgs.model_validate({"unknown_option": 1})


def test_build_app_binds_the_ingress_over_the_engine_with_validated_args() -> None:
    app = build_app({"served_model_name": "m", "api_keys": KEYS})
    ingress = app._bound_deployment  # the application's entry
    assert ingress.name == "OpenAIIngress"
    engine_app, args = ingress.init_args
    assert ServeAppArgs.model_validate(args).tenants_by_key() == KEYS
    engine = engine_app._bound_deployment
    assert engine.name == "GenerationServer"
    (engine_args,) = engine.init_args
    assert engine_args == args


def test_stream_chunks_per_step_is_off_by_default_and_refuses_less_than_one() -> None:
    assert ServeAppArgs.model_validate({}).stream_chunks_per_step is None
    assert ServeAppArgs.model_validate({"stream_chunks_per_step": 2}).stream_chunks_per_step == 2
    for bad in (0, -1, "x"):
        with pytest.raises(ValidationError, match="stream_chunks_per_step"):
            ServeAppArgs.model_validate({"stream_chunks_per_step": bad})


def test_stream_interval_defaults_to_every_token_and_refuses_less_than_one() -> None:
    assert ServeAppArgs.model_validate({}).stream_interval == 1
    assert ServeAppArgs.model_validate({"stream_interval": 8}).stream_interval == 8
    for bad in (0, -1, "x"):
        with pytest.raises(ValidationError, match="stream_interval"):
            ServeAppArgs.model_validate({"stream_interval": bad})
