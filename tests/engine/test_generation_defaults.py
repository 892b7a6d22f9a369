"""The model's generation defaults (`--generation-config`, `--override-generation-config`): read
from an HF directory's generation_config.json, a GGUF file's llama.cpp sampling keys, the
default model's card, or nowhere (`vllm`), overridden key by key, refused with the key named;
and the offline `LLM` uses them when given no sampling parameters."""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import gguf
import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.errors import ConfigError
from cluster.engine.generation_defaults import (
    GenerationDefaults,
    generation_defaults,
    load_generation_defaults,
)
from cluster.engine.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.serving.cli import main
from tests.engine.tiny_engine import PROMPTS, tiny_config
from workers.model_source import DEFAULT_MODEL_SAMPLING


def _defaults(**model: Any) -> GenerationDefaults:
    return generation_defaults(EngineConfig.build({"model": model}).model)


def _hf_dir(directory: pathlib.Path, generation: dict[str, Any]) -> pathlib.Path:
    """An HF directory as far as the defaults read it: config.json and generation_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


def _gguf_with_sampling(path: pathlib.Path, **keys: float) -> pathlib.Path:
    """A GGUF file holding only metadata, written by the gguf package as llama.cpp's converter
    writes a model's recommended sampling (`general.sampling.*`)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in keys.items():
        getattr(writer, f"add_sampling_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_hf_directory_gives_its_generation_config_sampling_keys(tmp_path: pathlib.Path) -> None:
    model = _hf_dir(
        tmp_path / "m",
        {
            "do_sample": True,
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "max_new_tokens": 300,
            "eos_token_id": [1, 2],  # not sampling: not ours to read
        },
    )
    defaults = _defaults(model=str(model))
    assert defaults.given() == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 300,
    }
    assert "generation_config.json" in defaults.source


def test_do_sample_false_is_greedy_as_in_hf(tmp_path: pathlib.Path) -> None:
    model = _hf_dir(tmp_path / "m", {"do_sample": False, "temperature": 0.7, "top_p": 0.8})
    assert _defaults(model=str(model)).given() == {"temperature": 0.0, "top_p": 0.8}


def test_a_gguf_files_sampling_metadata_and_a_config_beside_it(tmp_path: pathlib.Path) -> None:
    path = _gguf_with_sampling(
        tmp_path / "m.gguf", temp=0.3, top_k=40, top_p=0.9, min_p=0.1, penalty_repeat=1.05
    )
    assert _defaults(model=str(path)).given() == {
        "temperature": 0.3,
        "top_k": 40,
        "top_p": 0.9,
        "min_p": 0.1,
        "repetition_penalty": 1.05,
    }
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    beside = _defaults(model=str(path))
    assert beside.temperature == 0.5 and beside.top_k == 40  # key by key over the file's
    (tmp_path / "bare").mkdir()
    bare = _gguf_with_sampling(tmp_path / "bare" / "m.gguf")
    assert _defaults(model=str(bare)).given() == {}


def test_the_shipped_default_model_gets_its_model_cards_recommendation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = EngineConfig().model
    with caplog.at_level(logging.INFO, logger="cluster.engine.generation_defaults"):
        defaults = load_generation_defaults(settings)
    assert defaults.given() == {"temperature": 0.2, "top_p": 0.9} == dict(DEFAULT_MODEL_SAMPLING)
    (record,) = caplog.records  # once, a warning (vLLM's), saying what and from where
    assert record.levelno == logging.WARNING
    assert "model card" in record.message and "temperature=0.2, top_p=0.9" in record.message
    assert _defaults(model="default", generation_config="vllm").given() == {}


def test_overrides_merge_over_the_model_and_alone_with_vllm() -> None:
    override = '{"temperature": 0.5, "max_new_tokens": 7}'  # the flag's JSON text
    merged = _defaults(model="default", override_generation_config=override)
    assert merged.given() == {"temperature": 0.5, "top_p": 0.9, "max_tokens": 7}
    alone = _defaults(
        model="default", generation_config="vllm", override_generation_config=override
    )
    assert alone.given() == {"temperature": 0.5, "max_tokens": 7}
    assert alone.sampling_params() == SamplingParams(temperature=0.5, max_tokens=7)


def test_a_folder_given_as_the_generation_config(tmp_path: pathlib.Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 5}))
    assert _defaults(model="default", generation_config=str(tmp_path)).given() == {"top_k": 5}
    with pytest.raises(ValueError, match=r"no generation_config\.json there"):
        _defaults(model="default", generation_config=str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ('{"temp": 0.5}', "unknown keys ['temp']"),
        ('{"temperature": -1}', "temperature must be >= 0"),
        ('{"top_p": 0}', "top_p must be in (0, 1]"),
        ('{"top_k": 2.5}', "top_k must be an integer"),
        ('{"max_new_tokens": 0}', "max_new_tokens: max_tokens must be"),
        ('{"temperature": "hot"}', "temperature must be a number"),
        ("temperature=0.5", "not JSON"),
        ("[0.5]", "must be a JSON object"),
    ],
)
def test_a_bad_override_is_a_config_error_naming_it(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.override_generation_config") as caught:
        EngineConfig.build({"model": {"override_generation_config": override}})
    assert fragment in str(caught.value)


def test_a_bad_override_flag_exits_2_before_loading_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["generate", "--override-generation-config", '{"temp": 1}']) == 2
    assert "unknown keys ['temp']" in capsys.readouterr().err


def test_a_bad_value_in_the_models_file_fails_the_start_check(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    config = tiny_config(tiny_model_dir, model={"generation_config": str(tmp_path)})
    with pytest.raises(ConfigError, match="top_p must be in"):
        config.check_model()


def test_offline_llm_without_sampling_params_uses_the_defaults(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """A model config asking for greedy decoding of 5 tokens: `generate` with no parameters
    gives exactly what explicit greedy parameters of 5 tokens give."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "max_new_tokens": 5})
    )
    config = tiny_config(tiny_model_dir, model={"generation_config": str(tmp_path)})
    with LLM(config=config) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
        unset = llm.generate(PROMPTS[:3], use_tqdm=False)
        explicit = llm.generate(
            PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False
        )
    assert [o.outputs[0].token_ids for o in unset] == [o.outputs[0].token_ids for o in explicit]
    assert all(len(o.outputs[0].token_ids) == 5 for o in unset)


def test_generate_cli_flags_left_out_take_the_models_defaults(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "max_new_tokens": 3})
    )
    common = ["generate", "hi", "--raw", "--json", "--model", str(tiny_model_dir)]
    common += ["--generation-config", str(tmp_path)]

    def token_ids(*flags: str) -> list[int]:
        assert main([*common, *flags]) == 0
        record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        return record["outputs"][0]["token_ids"]

    greedy = token_ids()
    assert len(greedy) == 3  # the model's max_new_tokens, not the command's 64
    assert token_ids("--max-tokens", "5", "--temperature", "0")[:3] == greedy
