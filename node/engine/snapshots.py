"""Snapshots: the half of a replica that is not blocks, for models whose cache is not all per position.

- Window mode (`llamacpp.swa = "window"`): llama.cpp keeps only the last `n_swa` positions of a
  sliding-window model's window layers (llama-server's default, a fraction of a full cache's
  memory). A sequence resumes at a position P from its blocks up to P (the full-attention layers)
  and the window layers' cells for [P - n_swa, P).
- Hybrid models (Qwen3-Next, Granite 4.0-H, LFM2, Nemotron-H, Jamba): blocks hold the attention
  layers, and the recurrent state, which exists only where a sequence ends, is kept as it stood at P.

Either way the snapshot is taken when the sequence stood at P: the runner takes one at the last
block boundary of each prompt and at each block boundary decoding crosses (llama-server's
checkpoints). The newest one the replica's blocks reach travels with them, a frame of the same
kv_share push after the last block (`node.kvshare.wire`), and is kept in the replica store beside
them (`node.kvshare.store`), so a peer or a restarted host resumes from the pair. A snapshot is usable
only by a prompt that extends its tokens exactly, so it is keyed by a digest of them (`snapshot_key`):
equal on every host for the same tokens, whoever computed them. Its bytes are checked
(`llamastate.check_snapshot`, `Snapshots.check`) before they are kept, so a restore never reads a
wrong state.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash


def snapshot_key(tokens: np.ndarray) -> bytes:
    """Names a token prefix: what a snapshot taken after exactly these tokens may continue."""
    return xxhash.xxh3_128(np.ascontiguousarray(tokens, dtype="<i4").tobytes()).digest()


def boundary_keys(tokens: np.ndarray, block_size: int, top: int) -> list[tuple[int, bytes]]:
    """(P, snapshot_key(tokens[:P])) for every block boundary P in (0, top], one streaming pass: the digest of
    a prefix is the running digest's state there, so a 32k-token prompt costs one read of its bytes."""
    t = np.ascontiguousarray(tokens[:top], dtype="<i4")
    h = xxhash.xxh3_128()
    keys = []
    for p in range(block_size, top + 1, block_size):
        h.update(t[p - block_size : p].tobytes())
        keys.append((p, h.copy().digest()))
    return keys


@dataclass(frozen=True)
class Snapshot:
    """The partial state (window cache cells or recurrent state) of a sequence that stood at `pos`, after the
    tokens named by `key`."""

    pos: int
    key: bytes
    blob: np.ndarray  # uint8: llama.cpp's partial sequence state (magic, seq id, the window or recurrent section)

    @property
    def nbytes(self) -> int:
        return int(self.blob.nbytes)


class Snapshots:
    """Snapshots of this host's sequences and its peers', least recently used dropped past a byte budget.

    Written on the compute thread (snapshots taken mid-turn) and on the event loop (a peer's), read on
    both: a lock keeps the table whole."""

    def __init__(self, budget_bytes: int, check: Callable[[np.ndarray, int], str | None], *, block_size: int):
        self.budget_bytes, self.block_size = budget_bytes, block_size
        self._check = check  # why a blob must not be kept as the snapshot at a position (None: sound)
        self._by_key: collections.OrderedDict[bytes, Snapshot] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.last_bytes = 0  # the size of the last one kept: a model's snapshots are all about this size
        self.taken = self.received = self.refused = self.restored = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def check(self, pos: int, blob: np.ndarray) -> str | None:
        """Why `blob` must not be kept as the snapshot at `pos` (None: it may); counts nothing, keeps nothing."""
        if pos % self.block_size:
            return f"position {pos} is not a multiple of the block size {self.block_size}"
        if blob.nbytes > self.budget_bytes:
            return f"a {blob.nbytes}-byte snapshot exceeds the {self.budget_bytes}-byte budget"
        return self._check(blob, pos)

    def put(self, tokens: np.ndarray, blob: np.ndarray, *, received: bool = False) -> str | None:
        """Keep `blob` as the snapshot after exactly `tokens`; returns why it was refused, or None. Snapshots
        stand at block boundaries (where the runner takes them), so a lookup tries only those."""
        why = self.check(len(tokens), blob)
        if why is not None:
            self.refused += 1
            return why
        w = Snapshot(len(tokens), snapshot_key(tokens), np.ascontiguousarray(blob, dtype=np.uint8))
        self.last_bytes = w.nbytes
        with self._lock:
            old = self._by_key.pop(w.key, None)
            self.bytes += w.nbytes - (old.nbytes if old is not None else 0)
            self._by_key[w.key] = w
            while self.bytes > self.budget_bytes:
                _, gone = self._by_key.popitem(last=False)
                self.bytes -= gone.nbytes
        if received:
            self.received += 1
        else:
            self.taken += 1
        return None

    def newest(self, tokens: np.ndarray, limit: int | None = None) -> Snapshot | None:
        """The snapshot at the furthest position <= `limit` (default: all of `tokens`) that `tokens` extend."""
        top = len(tokens) if limit is None else min(limit, len(tokens))
        keys = boundary_keys(tokens, self.block_size, top)
        with self._lock:
            for _, key in reversed(keys):
                if (w := self._by_key.get(key)) is not None:
                    self._by_key.move_to_end(key)
                    return w
        return None

    def drop(self, w: Snapshot) -> None:
        with self._lock:
            if self._by_key.get(w.key) is w:
                del self._by_key[w.key]
                self.bytes -= w.nbytes

    def usable(self, tokens: np.ndarray, n: int) -> int:
        """How much of the `n` block-resident tokens of `tokens` a turn may reuse: up to the newest snapshot."""
        w = self.newest(tokens, n)
        return 0 if w is None else w.pos

    def stats(self) -> dict[str, int]:
        return {"snapshots": len(self), "bytes": self.bytes, "taken": self.taken, "received": self.received,
                "refused": self.refused, "restored": self.restored}
