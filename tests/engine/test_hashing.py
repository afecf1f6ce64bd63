"""Chained block hashes: h_i = xxh3_128(h_{i-1} || int32-LE tokens of block i), seeded by fingerprint."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.node.engine.hashing import HASH_BYTES, TOKEN_DTYPE, as_tokens, block_hashes, chain_seed, payload_digest

BS = 16


def _toks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 262, size=n).astype(np.int32)


def test_chain_seed_depends_on_fingerprint() -> None:
    """The chain seed is 16 bytes, stable, and differs per model fingerprint."""
    a, b = chain_seed("fp-a"), chain_seed("fp-b")
    assert len(a) == HASH_BYTES
    assert a == chain_seed("fp-a")
    assert a != b


def test_hash_definition_matches_design() -> None:
    """Block 0's hash is xxh3_128(seed || tokens as little-endian int32); block 1 chains on it."""
    seed = chain_seed("fp")
    toks = _toks(2 * BS)
    h = block_hashes(seed, toks, BS)
    h0 = xxhash.xxh3_128_digest(seed + toks[:BS].astype("<i4").tobytes())
    h1 = xxhash.xxh3_128_digest(h0 + toks[BS:].astype("<i4").tobytes())
    assert h == [h0, h1]


def test_only_full_blocks_are_hashed() -> None:
    """A partial trailing block has no hash."""
    seed = chain_seed("fp")
    assert len(block_hashes(seed, _toks(BS - 1), BS)) == 0
    assert len(block_hashes(seed, _toks(3 * BS), BS)) == 3
    assert len(block_hashes(seed, _toks(3 * BS + 5), BS)) == 3


def test_hash_names_whole_prefix() -> None:
    """Changing a token in block k changes hash k and every later hash, never an earlier one."""
    seed = chain_seed("fp")
    toks = _toks(4 * BS)
    base = block_hashes(seed, toks, BS)
    for k in range(4):
        t2 = toks.copy()
        t2[k * BS + 3] = (t2[k * BS + 3] + 1) % 262
        h2 = block_hashes(seed, t2, BS)
        assert h2[:k] == base[:k]
        assert all(a != b for a, b in zip(h2[k:], base[k:]))


def test_seed_changes_every_hash() -> None:
    """The same tokens under another fingerprint share no block hash (caches never mix across models)."""
    toks = _toks(3 * BS)
    a = block_hashes(chain_seed("fp-a"), toks, BS)
    b = block_hashes(chain_seed("fp-b"), toks, BS)
    assert not set(a) & set(b)


def test_token_dtype_is_fixed() -> None:
    """Python ints, int64 and int32 arrays of the same ids hash identically."""
    seed = chain_seed("fp")
    toks = _toks(2 * BS)
    ref = block_hashes(seed, toks, BS)
    assert block_hashes(seed, toks.tolist(), BS) == ref  # type: ignore[arg-type]
    assert block_hashes(seed, toks.astype(np.int64), BS) == ref
    assert block_hashes(seed, toks.astype(">i4"), BS) == ref  # big-endian input is normalised
    out = as_tokens(toks.astype(np.int64))
    assert out.dtype == TOKEN_DTYPE and out.flags["C_CONTIGUOUS"]


def test_noncontiguous_input_hashes_like_contiguous() -> None:
    """A strided view of tokens hashes like its contiguous copy."""
    seed = chain_seed("fp")
    wide = _toks(4 * BS)
    view = wide[::2]
    assert block_hashes(seed, view, BS) == block_hashes(seed, view.copy(), BS)


@settings(max_examples=30, deadline=None, database=None)
@given(n=st.integers(0, 6 * BS + 7), start=st.integers(0, 6))
def test_resume_from_prev_equals_full_chain(n: int, start: int) -> None:
    """block_hashes(start=k, prev=h[k-1]) equals the full chain's tail (how a turn extends a table)."""
    seed = chain_seed("fp")
    toks = _toks(n, seed=n)
    full = block_hashes(seed, toks, BS)
    k = min(start, len(full))
    prev = full[k - 1] if k else None
    assert block_hashes(seed, toks, BS, start=k, prev=prev) == full[k:]


@pytest.mark.parametrize("kind", ["bytes", "memoryview", "ndarray"])
def test_payload_digest_is_content_hash(kind: str) -> None:
    """payload_digest depends only on the bytes (any buffer type) and detects a flipped byte."""
    raw = bytes(range(256)) * 4
    data = {"bytes": raw, "memoryview": memoryview(raw), "ndarray": np.frombuffer(raw, dtype=np.uint8)}[kind]
    d = payload_digest(data)
    assert len(d) == HASH_BYTES
    assert d == payload_digest(raw)
    flipped = bytearray(raw)
    flipped[100] ^= 1
    assert payload_digest(bytes(flipped)) != d
