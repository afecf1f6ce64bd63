"""The host block pool's bytes in one shared-memory file, as the node and the connector inside vLLM see it.

The node creates the file (under /dev/shm) and keeps the only index of it (which block holds which
chained hash); vLLM's worker maps the same file and copies blocks between it and its paged cache
(node.engine.vllm.connector). Both import this module, so it uses the standard library and numpy only.

File: a 4 KiB header (magic, geometry, then the worker's description of its KV layout as JSON),
a digest per block (16 bytes), a state byte per block, then the blocks, page aligned. A block's
digest is written by whoever wrote its bytes (the worker after a save, the node after a replica
landed) and checked by the worker before a load: a block whose bytes do not match is refused and
vLLM recomputes it (`get_block_ids_with_load_errors`), and its state becomes BAD so the node stops
advertising it.

One kvmesh block of B tokens is K = B / b of vLLM's blocks (b tokens each). Its bytes are the
attention layers in order, each as K slabs, a slab being one vLLM block of one layer exactly as the
worker's cache holds it (`cache.select(block_dim, id)`): [layers, K, *slab_shape].
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"KVMSHPL1"
HEADER_BYTES = 4096
_FIXED = struct.Struct("<8sQQ")  # magic, num_blocks, block_bytes; the layout JSON follows, NUL padded
DIGEST_BYTES = 16
PAGE = 4096

EMPTY, SEALED, BAD = 0, 2, 3  # a block's state byte


def digest(data: memoryview | bytes | np.ndarray) -> bytes:
    """A block's integrity digest (SHA-256, hardware accelerated on x86-64 with SHA-NI; the first 16 bytes)."""
    return hashlib.sha256(data).digest()[:DIGEST_BYTES]  # type: ignore[arg-type]  # ndarrays are buffers


@dataclass(frozen=True)
class Geometry:
    """Where each part of the file lies."""

    num_blocks: int
    block_bytes: int

    @property
    def digests_at(self) -> int:
        return HEADER_BYTES

    @property
    def states_at(self) -> int:
        return HEADER_BYTES + self.num_blocks * DIGEST_BYTES

    @property
    def data_at(self) -> int:
        end = self.states_at + self.num_blocks
        return -(-end // PAGE) * PAGE

    @property
    def file_bytes(self) -> int:
        return self.data_at + self.num_blocks * self.block_bytes


class PoolFile:
    """The mapped file. `create` (the node) sizes and touches it; `open` (the worker) maps what exists."""

    def __init__(self, path: Path, fd: int, geometry: Geometry):
        self.path, self.geometry = path, geometry
        self._mm = mmap.mmap(fd, geometry.file_bytes)
        os.close(fd)
        self.bytes = np.frombuffer(self._mm, dtype=np.uint8)
        g = geometry
        self.digests = self.bytes[g.digests_at : g.states_at].reshape(g.num_blocks, DIGEST_BYTES)
        self.states = self.bytes[g.states_at : g.states_at + g.num_blocks]
        self.blocks = self.bytes[g.data_at :].reshape(g.num_blocks, g.block_bytes)

    @classmethod
    def create(cls, path: Path, num_blocks: int, block_bytes: int) -> PoolFile:
        g = Geometry(num_blocks, block_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, g.file_bytes)
        pool = cls(path, fd, g)
        pool.bytes[:HEADER_BYTES] = 0
        pool.bytes[: _FIXED.size] = np.frombuffer(_FIXED.pack(MAGIC, num_blocks, block_bytes), dtype=np.uint8)
        pool.blocks[:] = 0  # touched once, at start: first touch of shared memory is slow (machine facts)
        return pool

    @classmethod
    def open(cls, path: Path) -> PoolFile:
        fd = os.open(path, os.O_RDWR)
        try:
            magic, num_blocks, block_bytes = _FIXED.unpack(os.pread(fd, _FIXED.size, 0))
        except BaseException:
            os.close(fd)
            raise
        if magic != MAGIC:
            os.close(fd)
            raise ValueError(f"{path} is not a kvmesh block pool (magic {magic!r})")
        return cls(path, fd, Geometry(num_blocks, block_bytes))

    def layout(self) -> dict[str, object] | None:
        """The worker's KV layout, once it has written it."""
        raw = self.bytes[_FIXED.size : HEADER_BYTES].tobytes().split(b"\0", 1)[0]
        return json.loads(raw) if raw else None

    def set_layout(self, layout: dict[str, object]) -> None:
        raw = json.dumps(layout, sort_keys=True).encode()
        if len(raw) >= HEADER_BYTES - _FIXED.size:
            raise ValueError("the KV layout does not fit the pool header")
        self.bytes[_FIXED.size : HEADER_BYTES] = 0
        self.bytes[_FIXED.size : _FIXED.size + len(raw)] = np.frombuffer(raw, dtype=np.uint8)

    def seal(self, i: int) -> None:
        """Record block i's digest and mark it loadable (after its bytes are written)."""
        self.digests[i] = np.frombuffer(digest(self.blocks[i]), dtype=np.uint8)
        self.states[i] = SEALED

    def check(self, i: int) -> bool:
        """Whether block i is sealed and its bytes still match its digest."""
        return int(self.states[i]) == SEALED and digest(self.blocks[i]) == self.digests[i].tobytes()

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass  # a view of it is still alive somewhere; the mapping goes with the process


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int) -> int:
    """K and V of every attention layer for one token, from a Hugging Face config.json."""
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return layers * 2 * kv_heads * head_dim * dtype_bytes
