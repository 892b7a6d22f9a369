"""Cache identity and hash chain: published test vectors, determinism, single-component misses."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import subprocess
import sys

import pytest

from block_manager import CacheIdentity, InvalidOperation, block_hash
from tests.block_manager.helpers import IDENTITY, SEED

# Published test vectors: any implementation of the chain must reproduce these digests.
IDENTITY_VECTOR = "e1b923f554ddd3c802fb72f4126edf0c2e620c9fab6b2c4677384b5fddd9dec6"
FULL_IDENTITY_VECTOR = "dbfad63030db07c53b0e09e2fb1615c0a994f0faea1cf9f1ad0ca2a99fd88857"
FIRST_BLOCK_VECTOR = "2e3feb823ba4dec0b30e90f425690ab322728803aac76ef759b679cd082b6599"
SECOND_BLOCK_VECTOR = "01087e161d4c0e49b3e990235f5b076a14fa58d328298b69f44f621094f23097"
ZERO_PARENT_VECTOR = "26b35990c6d58d586747db8c067862c33ecd1524c5473fcc0ebc21cc52ed69c3"

FULL_IDENTITY = CacheIdentity(
    model_weights_digest="sha256:weights-v1",
    tokenizer_digest="sha256:tok-v1",
    chat_template_digest="sha256:tpl",
    adapter_id="lora-a",
    adapter_weights_digest="sha256:lora",
    dtype="bfloat16",
    kv_cache_dtype="fp8_e4m3",
    block_size=32,
    rope="theta=500000;scaling=llama3;factor=8",
    quantization="q4_1",
)


def test_identity_vectors() -> None:
    assert IDENTITY.digest().hex() == IDENTITY_VECTOR
    assert FULL_IDENTITY.digest().hex() == FULL_IDENTITY_VECTOR
    assert len(IDENTITY.digest()) == 32


def test_block_hash_vectors() -> None:
    first = block_hash(SEED, list(range(16)))
    assert first.hex() == FIRST_BLOCK_VECTOR
    second = block_hash(first, [31999] * 16, ["tenant-salt", b"\x00\x01"])
    assert second.hex() == SECOND_BLOCK_VECTOR
    assert block_hash(bytes(32), [1, 2, 3]).hex() == ZERO_PARENT_VECTOR


def test_block_hash_matches_documented_byte_layout() -> None:
    # Independent re-derivation from the format in identity.py's docstring.
    parent = bytes(range(32))
    tokens = [5, 70000, 2**32 - 1]
    extra = [b"\xff", "é"]
    payload = (
        parent
        + struct.pack("<I", 3)
        + struct.pack("<3I", *tokens)
        + struct.pack("<I", 2)
        + b"b" + struct.pack("<I", 1) + b"\xff"
        + b"s" + struct.pack("<I", 2) + "é".encode()
    )  # fmt: skip
    assert block_hash(parent, tokens, extra) == hashlib.sha256(payload).digest()


def test_digest_is_identical_in_another_process() -> None:
    code = (
        "from block_manager import block_hash\n"
        "from tests.block_manager.test_identity import FULL_IDENTITY\n"
        "print(block_hash(FULL_IDENTITY.digest(), [1, 2, 3], ['salt']).hex())"
    )
    env_out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
    ).stdout.strip()
    assert env_out == block_hash(FULL_IDENTITY.digest(), [1, 2, 3], ["salt"]).hex()


def _changed_values() -> list[tuple[str, object]]:
    return [
        ("model_weights_digest", "sha256:weights-v1x"),
        ("tokenizer_digest", "sha256:tok-v2"),
        ("chat_template_digest", "sha256:tpl2"),
        ("dtype", "float16"),
        ("kv_cache_dtype", "fp8_e5m2"),
        ("block_size", 16),
        ("rope", "theta=500000;scaling=llama3;factor=4"),
        ("quantization", "q8_0"),
    ]


@pytest.mark.parametrize(("name", "value"), _changed_values())
def test_changing_any_single_component_changes_the_digest(name: str, value: object) -> None:
    changed = dataclasses.replace(FULL_IDENTITY, **{name: value})
    assert changed.digest() != FULL_IDENTITY.digest()
    tokens = list(range(32))
    assert block_hash(changed.digest(), tokens) != block_hash(FULL_IDENTITY.digest(), tokens)


def test_adapter_changes_the_digest() -> None:
    no_adapter = dataclasses.replace(FULL_IDENTITY, adapter_id=None, adapter_weights_digest=None)
    other_weights = dataclasses.replace(FULL_IDENTITY, adapter_weights_digest="sha256:lora2")
    other_id = dataclasses.replace(FULL_IDENTITY, adapter_id="lora-b")
    digests = {d.digest() for d in (FULL_IDENTITY, no_adapter, other_weights, other_id)}
    assert len(digests) == 4


def test_none_is_not_the_empty_string() -> None:
    with_none = CacheIdentity(model_weights_digest="w", tokenizer_digest="t")
    with_empty = CacheIdentity(
        model_weights_digest="w", tokenizer_digest="t", adapter_id="", adapter_weights_digest=""
    )
    assert with_none.digest() != with_empty.digest()


def test_salt_and_single_token_change_the_hash() -> None:
    tokens = list(range(16))
    base = block_hash(SEED, tokens, ["tenant-a"])
    assert block_hash(SEED, tokens, ["tenant-b"]) != base
    assert block_hash(SEED, tokens) != base
    assert block_hash(SEED, tokens, [b"tenant-a"]) != base  # str and bytes keys differ
    assert block_hash(SEED, tokens, ["tenant-", "a"]) != base  # keys are length-delimited
    for position in range(16):
        changed = list(tokens)
        changed[position] += 1
        assert block_hash(SEED, changed, ["tenant-a"]) != base
    assert block_hash(SEED, tokens[:15], ["tenant-a"]) != base


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 12}, "power of two"),
        ({"block_size": 0}, "power of two"),
        ({"block_size": -16}, "power of two"),
        ({"model_weights_digest": ""}, "must not be empty"),
        ({"tokenizer_digest": 5}, "must be a str"),
        ({"adapter_id": "x"}, "given together"),
        ({"dtype": None}, "must be a str"),
    ],
)
def test_identity_rejects_bad_input(kwargs: dict[str, object], message: str) -> None:
    fields = {"model_weights_digest": "w", "tokenizer_digest": "t", **kwargs}
    with pytest.raises(InvalidOperation, match=message):
        CacheIdentity(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("parent", "tokens", "extra"),
    [
        (b"short", [1], ()),
        ("0" * 32, [1], ()),
        (bytes(32), [-1], ()),
        (bytes(32), [2**32], ()),
        (bytes(32), [1.5], ()),
        (bytes(32), [1], "salt"),
        (bytes(32), [1], [3]),
    ],
)
def test_block_hash_rejects_bad_input(parent: object, tokens: object, extra: object) -> None:
    with pytest.raises(InvalidOperation):
        block_hash(parent, tokens, extra)  # type: ignore[arg-type]
