"""LoRA serving settings without a cluster: `lora_modules` in every accepted spelling, the
runtime-updating switch, admin API keys, and `pagedserve serve`'s LoRA flags."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from cluster.serving.app_args import ServeAppArgs
from cluster.serving.cli import main
from cluster.serving.cli_serve import add_serve_arguments, resolve_serve_config
from cluster.serving.tenancy import Forbidden, Tenancy, Unauthenticated

NORMALISED = [
    {"name": "sql", "path": "/adapters/sql", "base_model_name": None},
    {"name": "chat", "path": "/adapters/chat", "base_model_name": "base"},
]


@pytest.mark.parametrize(
    "modules",
    [
        [
            {"name": "sql", "path": "/adapters/sql"},
            {"name": "chat", "path": "/adapters/chat", "base_model_name": "base"},
        ],
        [
            "sql=/adapters/sql",
            '{"name": "chat", "path": "/adapters/chat", "base_model_name": "base"}',
        ],
    ],
)
def test_lora_modules_spellings_normalise_alike(modules: object) -> None:
    args = ServeAppArgs.model_validate({"served_model_name": "base", "lora_modules": modules})
    assert [m.model_dump() for m in args.lora_modules] == NORMALISED


def test_the_short_mapping_form_and_what_it_turns_on() -> None:
    args = ServeAppArgs.model_validate(
        {"served_model_name": "base", "lora_modules": {"sql": "/a", "chat": "/b"}}
    )
    assert [(a.lora_name, a.lora_int_id, a.lora_path, a.base_model_name)
            for a in args.configured_adapters()] == [
        ("sql", 1, "/a", "base"),
        ("chat", 2, "/b", "base"),
    ]  # fmt: skip
    assert args.engine_config().lora.enable_lora
    assert not ServeAppArgs().engine_config().lora.enable_lora
    runtime = ServeAppArgs.model_validate({"allow_runtime_lora_updating": True})
    assert runtime.engine_config().lora.enable_lora
    assert ServeAppArgs.model_validate(runtime.model_dump()) == runtime  # survives bind_app


@pytest.mark.parametrize(
    ("modules", "fragment"),
    [
        ({"base": "/a"}, "served model's name"),
        ([{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}], "given twice"),
        ({"has space": "/a"}, "pattern"),
        ({"a": ""}, "at least 1"),
        ([{"name": "a"}], "path"),
        (["a"], "name=path"),
        (["{not json"], "not valid JSON"),
        ("a=/x", "list"),
    ],
)
def test_bad_lora_modules_are_refused_naming_the_problem(modules: object, fragment: str) -> None:
    with pytest.raises((ValidationError, ValueError), match=fragment):
        ServeAppArgs.model_validate({"served_model_name": "base", "lora_modules": modules})


def test_admin_keys_are_marked_in_api_keys_and_only_they_pass() -> None:
    args = ServeAppArgs.model_validate(
        {"api_keys": {"k-alice": "alice", "k-ops": {"tenant": "ops", "admin": True}}}
    )
    assert args.tenants_by_key() == {"k-alice": "alice", "k-ops": "ops"}
    assert args.admin_keys() == {"k-ops"}
    tenancy = Tenancy(args.tenants_by_key(), args.admin_keys())
    tenancy.authorize_admin("Bearer k-ops")
    with pytest.raises(Forbidden):
        tenancy.authorize_admin("Bearer k-alice")
    for header in (None, "Bearer nope", "Basic k-ops"):
        with pytest.raises(Unauthenticated):
            tenancy.authorize_admin(header)
    Tenancy().authorize_admin(None)  # no keys configured: no authentication at all
    assert tenancy.salt_for("Bearer k-ops") != tenancy.salt_for("Bearer k-alice")
    with pytest.raises(ValidationError, match="tenant"):
        ServeAppArgs.model_validate({"api_keys": {"k": {"admin": True}}})


def _serve(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def test_serve_flags_write_the_lora_settings_into_the_app_args() -> None:
    config = resolve_serve_config(
        _serve(
            "--lora-modules",
            "sql=/adapters/sql",
            '{"name": "chat", "path": "/adapters/chat"}',
            "--allow-runtime-lora-updating",
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "16",
        )
    )
    (app,) = config["applications"]
    args = ServeAppArgs.model_validate(app["args"])
    assert [m.name for m in args.lora_modules] == ["sql", "chat"]
    assert args.allow_runtime_lora_updating
    lora = args.engine_config().lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank) == (True, 2, 16)
    plain = resolve_serve_config(_serve())["applications"][0]["args"]
    assert "lora_modules" not in plain and "lora" not in plain["engine"]


def test_a_bad_lora_modules_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--print-config", "--lora-modules", "no-equals-sign"]) == 2
    assert "name=path" in capsys.readouterr().err
