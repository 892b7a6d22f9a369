"""`read_gguf_header` against the `gguf` package's own `GGUFReader` (the oracle): every
field's contents and every tensor's name, dims, type and data (dtype, shape, bytes) equal, on
the default model's file and on files the `gguf` writer makes (quantized matrices, alignment,
arrays of each kind); a cut or corrupt file is a ValueError, and the model spec read through
it names the file."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import transformers

from tests.workers.gguf_writer import write_llama_gguf
from workers import resolve_model_path
from workers.gguf_header import read_gguf_header
from workers.loader import read_metadata


def assert_same_as_gguf_reader(path: pathlib.Path) -> None:
    header, oracle = read_gguf_header(path), gguf.GGUFReader(str(path))
    assert list(header.fields) == list(oracle.fields)
    for key, field in oracle.fields.items():
        assert header.fields[key].contents() == field.contents(), key
    assert [t.name for t in header.tensors] == [t.name for t in oracle.tensors]
    for ours, theirs in zip(header.tensors, oracle.tensors, strict=True):
        assert list(ours.shape) == list(theirs.shape), ours.name
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert ours.data.dtype == theirs.data.dtype, ours.name
        assert ours.data.shape == theirs.data.shape, ours.name
        assert np.array_equal(ours.data, theirs.data), ours.name


def test_the_default_models_header_equals_the_gguf_readers() -> None:
    assert_same_as_gguf_reader(resolve_model_path("default"))


def test_written_files_with_every_value_kind_equal_the_gguf_readers(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    path = write_llama_gguf(model, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    assert_same_as_gguf_reader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "kinds.gguf"), "llama")
    writer.add_custom_alignment(64)
    writer.add_array("test.strings", ["a", "", "naïve 🙂", "x" * 300])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.bools", [True, False, True])
    writer.add_bool("test.flag", True)
    writer.add_float64("test.f64", 1 / 3)
    writer.add_uint64("test.u64", 2**40)
    writer.add_int8("test.i8", -7)
    writer.add_tensor("v.weight", np.arange(6, dtype=np.float32))
    writer.add_tensor("h.weight", np.ones((2, 3), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_reader(tmp_path / "kinds.gguf")


def test_a_cut_or_foreign_file_is_a_value_error_naming_it(tmp_path: pathlib.Path) -> None:
    data = resolve_model_path("default").read_bytes()
    for cut in (8, 30_000, 3_000_000, len(data) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError):
            read_gguf_header(path)
        with pytest.raises(ValueError, match=rf"cut{cut}\.gguf is truncated or corrupt"):
            read_metadata(path)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"GGML" + data[4:4096])
    with pytest.raises(ValueError, match="bad magic"):
        read_gguf_header(foreign)
