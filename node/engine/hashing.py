"""Chained block hashes and payload digests.

`h_i = xxh3_128(h_{i-1} || token_ids_of_block_i)`, seeded with the model
fingerprint, so a hash names its whole prefix *and* the model that computed it.
Token ids are hashed as little-endian int32 on every host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

HASH_BYTES = 16
TOKEN_DTYPE = np.dtype("<i4")


def chain_seed(fingerprint: str) -> bytes:
    """The hash that precedes block 0 for a model with this fingerprint."""
    return xxhash.xxh3_128_digest(b"kvmesh/chain/v1|" + fingerprint.encode())


def as_tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids in the one dtype that is hashed and stored (contiguous <i4)."""
    return np.ascontiguousarray(token_ids, dtype=TOKEN_DTYPE)


def block_hashes(
    seed: bytes, tokens: np.ndarray, block_size: int, *, start: int = 0, prev: bytes | None = None
) -> list[bytes]:
    """Hashes of every *full* block of `tokens` from block index `start`.

    `prev` is the hash of block `start - 1` (or the seed when start == 0).
    """
    toks = as_tokens(tokens)
    h_prev = seed if prev is None else prev
    out: list[bytes] = []
    for i in range(start, len(toks) // block_size):
        h = xxhash.xxh3_128(h_prev)
        h.update(toks[i * block_size : (i + 1) * block_size].data)
        h_prev = h.digest()
        out.append(h_prev)
    return out


def payload_digest(data: memoryview | bytes | np.ndarray) -> bytes:
    """Integrity digest of a block's KV bytes (what kv_share verifies in flight)."""
    return xxhash.xxh3_128_digest(data)  # type: ignore[arg-type]  # ndarrays are buffers; numpy's stubs disagree
