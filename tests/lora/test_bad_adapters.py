"""Every bad adapter is refused naming its problem, and nothing already loaded is affected.

Each case copies the good `all8` adapter (PEFT's own files) and breaks one thing; the engine
serves `all8` throughout, and its output must be unchanged after every refusal.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Callable, Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.engine.errors import AdapterNotFound, InvalidAdapter
from cluster.engine.llm import LLM
from cluster.engine.lora_request import LoRARequest
from cluster.engine.sampling_params import SamplingParams
from tests.engine.tiny_engine import tiny_config
from tests.lora.adapters import copy_adapter
from workers.lora.peft_format import CONFIG_FILE, WEIGHTS_FILE

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = "The quick brown fox"
Breaker = Callable[[pathlib.Path], None]


def _edit_config(**changes: object) -> Breaker:
    def edit(directory: pathlib.Path) -> None:
        config = json.loads((directory / CONFIG_FILE).read_text())
        config.update(changes)
        (directory / CONFIG_FILE).write_text(json.dumps(config))

    return edit


def _edit_tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Breaker:
    def edit(directory: pathlib.Path) -> None:
        tensors = load_file(str(directory / WEIGHTS_FILE))
        change(tensors)
        save_file(tensors, str(directory / WEIGHTS_FILE))

    return edit


def _first(tensors: dict[str, torch.Tensor], part: str) -> str:
    return sorted(name for name in tensors if part in name)[0]


def _narrow(tensors: dict[str, torch.Tensor]) -> None:
    name = _first(tensors, "q_proj.lora_A")
    tensors[name] = tensors[name][:, :64].contiguous()


def _nan(tensors: dict[str, torch.Tensor]) -> None:
    tensors[_first(tensors, "down_proj.lora_B")][3, 1] = float("nan")


def _drop_b(tensors: dict[str, torch.Tensor]) -> None:
    del tensors[_first(tensors, "up_proj.lora_B")]


def _layer_out_of_range(tensors: dict[str, torch.Tensor]) -> None:
    for name in [n for n in tensors if ".layers.1." in n]:
        tensors[name.replace(".layers.1.", ".layers.7.")] = tensors.pop(name)


def _truncate(directory: pathlib.Path) -> None:
    data = (directory / WEIGHTS_FILE).read_bytes()
    (directory / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])


CASES: dict[str, tuple[Breaker, str]] = {
    "no_config": (lambda d: (d / CONFIG_FILE).unlink(), "has no adapter_config.json"),
    "bad_json": (lambda d: (d / CONFIG_FILE).write_text("{not json"), "not valid JSON"),
    "no_weights": (lambda d: (d / WEIGHTS_FILE).unlink(), "has no adapter_model.safetensors"),
    "corrupt_weights": (_truncate, "truncated or corrupt"),
    "rank_too_big": (_edit_config(r=32), "rank 32 exceeds max_lora_rank 16"),
    "bad_rank": (_edit_config(r=0), "r must be a positive integer"),
    "bad_alpha": (_edit_config(lora_alpha="big"), "lora_alpha must be a finite number"),
    "unknown_target": (
        _edit_config(target_modules=["q_proj", "lm_head"]),
        r"unknown target modules \['lm_head'\]",
    ),
    "dora": (_edit_config(use_dora=True), "use_dora is not supported"),
    "bias": (_edit_config(bias="all"), "bias 'all' is not supported"),
    "wrong_shape": (_edit_tensors(_narrow), r"has shape \[8, 64\] but rank 8 on the base"),
    "non_finite": (_edit_tensors(_nan), "non-finite values"),
    "missing_half": (_edit_tensors(_drop_b), "up_proj: lora_B is missing"),
    "layer_out_of_range": (_edit_tensors(_layer_out_of_range), "outside the model's 2 layers"),
}


@pytest.fixture(scope="module")
def serving(
    tiny_model_dir: pathlib.Path, tiny_adapters: dict[str, pathlib.Path]
) -> Iterator[tuple[LLM, list[int]]]:
    config = tiny_config(tiny_model_dir, lora={"enable_lora": True, "max_lora_rank": 16})
    with LLM(config=config) as llm:
        good = LoRARequest("all8", 1, str(tiny_adapters["all8"]))
        tokens = llm.generate(PROMPT, GREEDY, lora_request=good)[0].outputs[0].token_ids
        yield llm, tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_adapter_is_refused_and_nothing_loaded_changes(
    case: str,
    serving: tuple[LLM, list[int]],
    tiny_adapters: dict[str, pathlib.Path],
    tmp_path: pathlib.Path,
) -> None:
    llm, good_tokens = serving
    broken = copy_adapter(tiny_adapters["all8"], tmp_path / case)
    breaker, message = CASES[case]
    breaker(broken)
    with pytest.raises(InvalidAdapter, match=message):
        llm.add_lora(LoRARequest(f"bad-{case}", 9, str(broken)))
    assert [lora.lora_name for lora in llm.list_loras()] == ["all8"]
    again = llm.generate(PROMPT, GREEDY, lora_request=llm.list_loras()[0])
    assert again[0].outputs[0].token_ids == good_tokens
    assert not llm.engine.has_unfinished()


def test_bad_names_and_paths(
    serving: tuple[LLM, list[int]], tiny_adapters: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    llm, _ = serving
    with pytest.raises(InvalidAdapter, match="is not a directory"):
        llm.add_lora(LoRARequest("missing", 3, str(tmp_path / "nowhere")))
    with pytest.raises(InvalidAdapter, match="already loaded from"):
        llm.add_lora(LoRARequest("all8", 1, str(tiny_adapters["qv16"])))
    with pytest.raises(AdapterNotFound, match="'nope' is not loaded"):
        llm.remove_lora("nope")
    request = llm.engine.request_builder.build(PROMPT, GREEDY, adapter="nope")
    with pytest.raises(AdapterNotFound, match="'nope' is not loaded"):
        llm.engine.add_request(request)
    assert not llm.engine.has_unfinished() and not llm.engine.scheduler.waiting
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, str(tmp_path))
    with pytest.raises(ValueError, match="2 lora requests for 1 prompts"):
        llm.generate([PROMPT], GREEDY, lora_request=[None, None])


def test_digest_follows_the_weights_not_the_place(
    tiny_model_dir: pathlib.Path, tiny_adapters: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    from workers.lora import load_peft_adapter
    from workers.model_source import spec_from_hf_directory

    spec = spec_from_hf_directory(tiny_model_dir)
    original = load_peft_adapter(tiny_adapters["all8"], spec, 16)
    copied = load_peft_adapter(copy_adapter(tiny_adapters["all8"], tmp_path / "c"), spec, 16)
    assert copied.digest == original.digest
    rescaled = copy_adapter(tiny_adapters["all8"], tmp_path / "alpha")
    _edit_config(lora_alpha=32)(rescaled)
    assert load_peft_adapter(rescaled, spec, 16).digest != original.digest
    other = load_peft_adapter(tiny_adapters["qv16"], spec, 16)
    assert other.digest != original.digest
    rslora = load_peft_adapter(tiny_adapters["rs4"], spec, 16)
    assert rslora.scaling == pytest.approx(16 / 4**0.5)  # alpha / sqrt(r)
    assert original.scaling == pytest.approx(16 / 8)
    shutil.rmtree(tmp_path / "c")
