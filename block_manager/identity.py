"""Exact cache identity and the deterministic block hash chain.

A block's hash is ``sha256(parent || u32le(len(tokens)) || tokens as u32le || extra)`` where
``parent`` is the previous block's hash (32 bytes) or, for the first block, the seed
``CacheIdentity.digest()``, and ``extra`` is the self-delimiting encoding of the extra keys
(adapter, tenant salt, ...). Nothing depends on Python's ``hash()``, the process or the machine's
byte order, so the same inputs give the same digests everywhere (the tests pin published vectors).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from block_manager.errors import InvalidOperation

HASH_BYTES = 32
_TOKEN_TYPECODE = "I" if array("I").itemsize == 4 else "L"
_LITTLE_ENDIAN = sys.byteorder == "little"
_IDENTITY_DOMAIN = b"pagedserve.cache-identity.v1"
_NO_EXTRA_KEYS = struct.pack("<I", 0)


def new_token_array(token_ids: Sequence[int] = ()) -> array:
    """Token ids as a compact unsigned 32-bit array; raises `InvalidOperation` on a bad id."""
    try:
        return array(_TOKEN_TYPECODE, token_ids)
    except (OverflowError, TypeError) as exc:
        raise InvalidOperation(f"token ids must be integers in [0, 2**32): {exc}") from None


def tokens_to_bytes(tokens: array) -> bytes:
    """Little-endian u32 bytes of a token array (byte-swapped on big-endian machines)."""
    if _LITTLE_ENDIAN:
        return tokens.tobytes()
    swapped = array(_TOKEN_TYPECODE, tokens)
    swapped.byteswap()
    return swapped.tobytes()


def encode_extra_keys(extra_keys: Sequence[str | bytes]) -> bytes:
    """Self-delimiting encoding: u32 count, then per key a type tag (s/b), u32 length and bytes."""
    if isinstance(extra_keys, str | bytes):
        raise InvalidOperation("extra_keys must be a sequence of str or bytes, not a single value")
    if not extra_keys:
        return _NO_EXTRA_KEYS
    parts = [struct.pack("<I", len(extra_keys))]
    for key in extra_keys:
        if isinstance(key, str):
            data, tag = key.encode("utf-8"), b"s"
        elif isinstance(key, bytes | bytearray):
            data, tag = bytes(key), b"b"
        else:
            raise InvalidOperation(f"extra key {key!r} must be str or bytes")
        parts.append(tag + struct.pack("<I", len(data)) + data)
    return b"".join(parts)


def check_hash_seed(seed: bytes) -> bytes:
    """A hash seed (or parent hash) must be exactly 32 bytes, e.g. `CacheIdentity.digest()`."""
    if not isinstance(seed, bytes | bytearray) or len(seed) != HASH_BYTES:
        raise InvalidOperation(
            f"hash seed must be {HASH_BYTES} bytes (pass CacheIdentity.digest()), got {seed!r:.80}"
        )
    return bytes(seed)


def check_unsalted_blocks(unsalted_blocks: int, num_full_blocks: int) -> int:
    """Unsalted blocks must be an int in [0, the sequence's full blocks] (whole prompt blocks)."""
    if type(unsalted_blocks) is not int or unsalted_blocks < 0:
        raise InvalidOperation(f"unsalted_blocks must be an int >= 0, got {unsalted_blocks!r}")
    if unsalted_blocks > num_full_blocks:
        raise InvalidOperation(
            f"unsalted_blocks {unsalted_blocks} exceeds the sequence's {num_full_blocks} full "
            "blocks (only whole prompt blocks go unsalted)"
        )
    return unsalted_blocks


def block_hash(
    parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[str | bytes] = ()
) -> bytes:
    """Hash of one block from its parent's hash (or the identity seed), tokens and extra keys."""
    parent = check_hash_seed(parent)
    tokens = new_token_array(token_ids)
    key = block_key(parent, tokens_to_bytes(tokens), encode_extra_keys(extra_keys))
    return hashlib.sha256(key).digest()


def block_key(parent: bytes, token_bytes: bytes, suffix: bytes) -> bytes:
    """The preimage `block_hash` digests: parent, u32le token count, u32le tokens, extra keys."""
    return parent + (len(token_bytes) // 4).to_bytes(4, "little") + token_bytes + suffix


def block_suffix(index: int, suffix: bytes, unsalted_blocks: int) -> bytes:
    """The extra-key bytes of block `index`: none for the first `unsalted_blocks` blocks (an
    operator-shared prefix, the same for every tenant), `suffix` for the rest."""
    return _NO_EXTRA_KEYS if index < unsalted_blocks else suffix


def chain_blocks(
    parent: bytes, data: bytes, block_size: int, suffix: bytes, unsalted_blocks: int = 0
) -> tuple[list[bytes], list[bytes]]:
    """Preimages and chain hashes of the consecutive full blocks in `data` (u32le token bytes).

    `suffix` is ``encode_extra_keys(...)``, used from block `unsalted_blocks` on (the blocks
    before it carry no extra keys); each hash equals `block_hash` of that block.
    """
    prefix, width = block_size.to_bytes(4, "little"), block_size * 4
    sha256 = hashlib.sha256
    keys: list[bytes] = []
    digests: list[bytes] = []
    for start in range(0, len(data) - width + 1, width):
        extra = _NO_EXTRA_KEYS if start < unsalted_blocks * width else suffix
        key = parent + prefix + data[start : start + width] + extra
        parent = sha256(key).digest()
        keys.append(key)
        digests.append(parent)
    return keys, digests


def match_cached_prefix(
    cached: Mapping[bytes, int],
    block_hashes: Sequence[bytes | None],
    seed: bytes,
    data: bytes,
    block_size: int,
    suffix: bytes,
    max_blocks: int,
    unsalted_blocks: int = 0,
) -> tuple[list[int], list[bytes]]:
    """Blocks and chain hashes of the longest cached chain prefix (at most `max_blocks` blocks).

    `cached` maps a block's exact hash preimage to the block and `block_hashes[block]` is its
    hash, so each step is one exact dictionary lookup; a hit's hash is read, not recomputed.
    The first `unsalted_blocks` blocks are looked up without extra keys (see `block_suffix`).
    """
    prefix, width = block_size.to_bytes(4, "little"), block_size * 4
    lookup = cached.get
    blocks: list[int] = []
    hashes: list[bytes] = []
    parent = seed
    unsalted_end = unsalted_blocks * width
    for start in range(0, max_blocks * width, width):
        extra = _NO_EXTRA_KEYS if start < unsalted_end else suffix
        block = lookup(parent + prefix + data[start : start + width] + extra)
        if block is None:
            break
        digest = block_hashes[block]
        if digest is None:  # unreachable: a cached block always carries its hash
            break
        parent = digest
        blocks.append(block)
        hashes.append(digest)
    return blocks, hashes


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class CacheIdentity:
    """Everything that changes the KV values a token sequence produces; its digest seeds the chain.

    Two requests may share cached blocks only if their identities are equal field by field (and
    their extra keys and tokens match): any single differing component changes the digest.
    """

    model_weights_digest: str
    tokenizer_digest: str
    chat_template_digest: str = "none"
    adapter_id: str | None = None
    adapter_weights_digest: str | None = None
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    rope: str = ""
    quantization: str = "none"

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name == "block_size":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InvalidOperation(f"block_size must be an int, got {value!r}")
                if not _is_power_of_two(value):
                    raise InvalidOperation(f"block_size must be a power of two > 0, got {value}")
            elif spec.name in ("adapter_id", "adapter_weights_digest"):
                if value is not None and not isinstance(value, str):
                    raise InvalidOperation(f"{spec.name} must be a str or None, got {value!r}")
            elif not isinstance(value, str):
                raise InvalidOperation(f"{spec.name} must be a str, got {value!r}")
        for name in ("model_weights_digest", "tokenizer_digest"):
            if not getattr(self, name):
                raise InvalidOperation(f"{name} must not be empty")
        if (self.adapter_id is None) != (self.adapter_weights_digest is None):
            raise InvalidOperation("adapter_id and adapter_weights_digest must be given together")

    def digest(self) -> bytes:
        """32-byte sha256 over a canonical, length-prefixed encoding of every field (None != "")."""
        parts = [struct.pack("<I", len(_IDENTITY_DOMAIN)), _IDENTITY_DOMAIN]
        for spec in fields(self):
            value = getattr(self, spec.name)
            name = spec.name.encode("ascii")
            if value is None:
                data, tag = b"", b"n"
            elif isinstance(value, int):
                data, tag = str(value).encode("ascii"), b"i"
            else:
                data, tag = value.encode("utf-8"), b"s"
            parts += [struct.pack("<I", len(name)), name, tag, struct.pack("<I", len(data)), data]
        return hashlib.sha256(b"".join(parts)).digest()
