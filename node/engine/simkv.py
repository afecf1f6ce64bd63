"""The sim engine's KV bytes: bf16-like pseudo-random values, deterministic from the hash chain.

A sim block is token-major: token t of a block owns bytes [t * kvpt, (t + 1) * kvpt)
(kvpt: KV bytes per token, a multiple of 16). Each 64-bit word holds four bf16-like
lanes: the sign, the exponent's low 3 bits and the 7-bit mantissa are random, the
exponent's high bits are fixed, so every value has |x| in [2^-7, 2), a narrow
exponent band like real K/V activations. Lossless compressors shrink these bytes
about as much as they shrink real bf16 KV (zlib about 1.2x), not to nothing.

Like real KV, a token's bytes depend on its whole prefix and on nothing after it:
token t of block j is a slice of one fixed pseudo-random table (its start chosen by
h_{j-1}, the chain hash of the previous block) XORed with a 64-bit key of
(h_{j-1}, the block's tokens up to t). So a full block's bytes are a function of
what its chain hash h_j names, a partial block holds exactly the first tokens of
the full block it grows into, and two hosts holding the same tokens hold the same
bytes. Generation is one vectorised XOR per block (memory speed).

This module needs numpy and xxhash only, so tools that check sim content (the
chaos drill's store re-read) can use it without torch.
"""

from __future__ import annotations

import functools
import json
import sys
import time
import zlib

import numpy as np
import xxhash

WORD = np.dtype("<u8")
# Per bf16 lane of a little-endian word: bit 15 sign, bits 14..7 exponent, bits 6..0 mantissa.
RANDOM_BITS = np.uint64(0x83FF_83FF_83FF_83FF)  # sign, exponent bits 2..0, mantissa
FIXED_BITS = np.uint64(0x3C00_3C00_3C00_3C00)  # exponent bits 7..3 = 01111: exponents 120..127
_SLACK_WORDS = 1 << 17  # distinct table offsets a block may start at
_TABLE_SEED = 0x6B766D657368  # "kvmesh": the table is the same on every host
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_DIGEST_CHUNK = 1 << 20  # xxhash holds the GIL per call: feed big buffers in slices


@functools.lru_cache(maxsize=8)
def _table(block_words: int) -> np.ndarray:
    """The fixed bf16-like word table that blocks of `block_words` words are cut from."""
    w = np.random.PCG64(_TABLE_SEED).random_raw(block_words + _SLACK_WORDS)
    w &= RANDOM_BITS
    w |= FIXED_BITS
    w.flags.writeable = False
    return w


@functools.lru_cache(maxsize=32)
def _position_tags(n: int) -> np.ndarray:
    """Per-position constants 1*G, 2*G, ... (n of them, n a power of two)."""
    tags = np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN
    tags.flags.writeable = False
    return tags


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised and in place (uint64 arithmetic wraps)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def token_keys(prev: bytes, tokens: np.ndarray) -> np.ndarray:
    """One 64-bit key per token of a block: a function of `prev` and the block's tokens up to it."""
    n = len(tokens)
    a = np.asarray(tokens).astype(np.uint64)
    a += _position_tags(1 << max(0, n - 1).bit_length())[:n]  # position-tagged, so order matters
    a *= np.uint64(0xBF58476D1CE4E5B9)
    a ^= a >> np.uint64(29)
    acc = np.cumsum(a, dtype=np.uint64)
    acc ^= np.uint64(int.from_bytes(prev[:8], "little"))
    return _mix(acc)


def kv_words(prev: bytes, tokens: np.ndarray, kv_bytes_per_token: int, block_size: int, *, first: int = 0,
             out: np.ndarray | None = None) -> np.ndarray:
    """KV words of tokens [first, len(tokens)) of a block whose leading tokens are `tokens`.

    `prev` is the chain hash of the previous block (the chain seed for block 0). Returns
    (or fills `out` with) [len(tokens) - first, kv_bytes_per_token // 8] little-endian words."""
    if kv_bytes_per_token % 16 or len(tokens) > block_size:
        raise ValueError(f"{len(tokens)} tokens of {kv_bytes_per_token} bytes do not fit a sim block of {block_size}")
    wpt = kv_bytes_per_token // 8
    n = len(tokens) - first
    off = int.from_bytes(prev[8:16], "little") % _SLACK_WORDS + first * wpt
    src = _table(block_size * wpt)[off : off + n * wpt].reshape(n, wpt)
    keys = token_keys(prev, tokens)[first:] & RANDOM_BITS  # keeps the fixed exponent bits fixed
    if out is None:
        out = np.empty((n, wpt), dtype=WORD)
    np.bitwise_xor(src, keys[:, None], out=out)
    return out


def fill_block(buf: memoryview, prev: bytes, tokens: np.ndarray, kv_bytes_per_token: int, block_size: int) -> None:
    """Write the KV bytes of a block's leading `tokens` into the front of `buf` (a pool block)."""
    n = len(tokens)
    words = np.frombuffer(buf, dtype=WORD, count=n * kv_bytes_per_token // 8)
    kv_words(prev, tokens, kv_bytes_per_token, block_size, out=words.reshape(n, kv_bytes_per_token // 8))


def block_bytes(prev: bytes, tokens: np.ndarray, kv_bytes_per_token: int, block_size: int) -> bytes:
    """The bytes a sim engine holds for a block of these tokens after the block hashed `prev`."""
    return kv_words(prev, tokens, kv_bytes_per_token, block_size).tobytes()


def update_digest(h: xxhash.xxh3_128, data: memoryview | np.ndarray) -> None:
    """Feed bytes to a running digest in slices, so other threads get the GIL in between."""
    mv = memoryview(data).cast("B")  # type: ignore[arg-type]  # ndarrays are buffers; numpy's stubs disagree
    for lo in range(0, len(mv), _DIGEST_CHUNK):
        h.update(mv[lo : lo + _DIGEST_CHUNK])


def _bench(kv_bytes_per_token: int = 400, block_size: int = 256, seconds: float = 1.0) -> dict[str, float]:
    """Generation and digest rates and zlib's ratio on sim blocks of this geometry.

    Rates are GB per CPU second of this process (process_time), so a shared, loaded box
    reports what one core does, not how often the scheduler ran us."""
    rng = np.random.default_rng(1)
    out = np.empty((block_size, kv_bytes_per_token // 8), dtype=WORD)
    toks = rng.integers(0, 256, block_size, dtype=np.int32)
    _table(block_size * kv_bytes_per_token // 8)  # built once per geometry, not per block
    n, t0 = 0, time.process_time()
    while time.process_time() - t0 < seconds:
        kv_words(n.to_bytes(16, "little"), toks, kv_bytes_per_token, block_size, out=out)
        n += 1
    gen = n * out.nbytes / (time.process_time() - t0) / 1e9
    blob = b"".join(block_bytes(i.to_bytes(16, "little"), toks, kv_bytes_per_token, block_size) for i in range(8))
    n, t0 = 0, time.process_time()
    while time.process_time() - t0 < seconds / 2:
        xxhash.xxh3_128_digest(blob)
        n += 1
    dig = n * len(blob) / (time.process_time() - t0) / 1e9
    return {"kv_bytes_per_token": kv_bytes_per_token, "block_size": block_size, "generate_gb_per_cpu_s": round(gen, 2),
            "digest_gb_per_cpu_s": round(dig, 2), "zlib6_ratio": round(len(blob) / len(zlib.compress(blob, 6)), 3)}


if __name__ == "__main__":
    # python -m kvmesh.node.engine.simkv [kv_bytes_per_token] [block_size]: one JSON line.
    print(json.dumps(_bench(*(int(a) for a in sys.argv[1:3]))))
