"""The host-memory tier: KV blocks kept in host RAM between the engine's pool and the disk store.

As llama-server's `--cache-ram`, LMCache's CPU tier and SGLang's HiCache L2 do, a host keeps the blocks
it writes behind in a bounded, pre-touched arena of host memory, addressed like the engine's own pool:
by chain hash, the tokens compared to rule out a collision. The store's write-behind copies a session's
pool blocks here (one memcpy each) and lets go of the pool at once; the disk copy is written from here,
behind. A restore takes each block it finds here with one memory copy, and the rest from the disk store.

So the pool is pinned only for as long as a memory copy takes, not a disk write: a turn that must
restore its session while other turns' write-behinds are queued on the disk finds the pool free. A block
is pinned here while it is being staged, until its disk copy is written, and while a restore reads it;
unpinned blocks are reused least recently used first. Nothing here touches the engine: it is thread-safe
(one lock over the bookkeeping), and byte copies run on the callers' worker threads.

The arena is touched block by block on a worker thread at start (`pretouch`): fresh memory is slow to
fault in on first touch, and a block is handed out only once touched, so staging never pays for it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Block:
    hash: bytes | None = None
    tokens: np.ndarray | None = field(default=None, repr=False)
    pins: int = 0
    ready: bool = False  # its bytes are whole (staged): readable by a restore


@dataclass(frozen=True)
class Staged:
    """Tier blocks reserved for a write-behind's leading blocks, in order: `copy[k]` whether block k's bytes
    are still to be copied in (False: the tier held them already). Each is pinned until `HostTier.unpin`."""

    ids: list[int]
    copy: list[bool]


class HostTier:
    """A bounded arena of `n_blocks` KV blocks of `block_bytes` in host memory (see the module docstring)."""

    def __init__(self, n_blocks: int, block_bytes: int) -> None:
        if n_blocks < 0 or block_bytes <= 0:
            raise ValueError("a host tier needs n_blocks >= 0 and block_bytes > 0")
        self.n_blocks = n_blocks
        self.block_bytes = block_bytes
        self._raw = np.empty(n_blocks * block_bytes, dtype=np.uint8)  # faulted in by pretouch
        self._blocks = [_Block() for _ in range(n_blocks)]
        self._by_hash: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # touched, unpinned blocks, least recently used first
        self._touched = 0
        self._stop = False
        self._lock = threading.Lock()
        self.hits = 0  # blocks restores took from here (counted by the restores, on the engine's loop)
        self.staged = 0  # blocks copied in by write-behinds

    @property
    def capacity_bytes(self) -> int:
        return self.n_blocks * self.block_bytes

    def pretouch(self) -> None:
        """Fault the arena in, block by block, each usable once touched (a worker thread, at start)."""
        bb = self.block_bytes
        zero = np.zeros(bb, dtype=np.uint8)  # copied from, not filled: numpy's copy lets go of the GIL
        for i in range(self.n_blocks):
            if self._stop:
                return
            np.copyto(self._raw[i * bb : (i + 1) * bb], zero)
            with self._lock:
                self._idle[i] = None
                self._idle.move_to_end(i, last=False)  # empty: handed out first
                self._touched = i + 1

    def stop(self) -> None:
        self._stop = True

    def view(self, i: int) -> np.ndarray:
        """Block i's bytes (writable: a stage copies into its reserved blocks)."""
        bb = self.block_bytes
        return self._raw[i * bb : (i + 1) * bb]

    def stats(self) -> dict[str, int]:
        with self._lock:
            held = sum(1 for b in self._blocks if b.ready)
            pinned = sum(1 for b in self._blocks if b.pins)
        return {"bytes": self.capacity_bytes, "touched_bytes": self._touched * self.block_bytes,
                "held_blocks": held, "pinned_blocks": pinned, "hits": self.hits, "staged": self.staged}

    # ---- write-behind: pool -> tier -> disk ---------------------------------------------

    def stage(self, hashes: list[bytes], tokens: list[np.ndarray]) -> Staged | None:
        """Reserve a block for each (hash, tokens) in order, pinned: one this tier holds already, else a free
        one (the least recently used unpinned block given up), as many leading ones as there is room for
        (None: not one)."""
        with self._lock:
            ids: list[int] = []
            copy: list[bool] = []
            for h, toks in zip(hashes, tokens, strict=True):
                held = self._find(h, toks)
                if held is not None:
                    self._pin(held)
                    ids.append(held)
                    copy.append(False)
                    continue
                if not self._idle:
                    break
                bid, _ = self._idle.popitem(last=False)
                self._forget(bid)
                b = self._blocks[bid]
                b.hash, b.tokens, b.pins = h, toks.copy(), 1
                ids.append(bid)
                copy.append(True)
            return Staged(ids, copy) if ids else None

    def staged_whole(self, st: Staged) -> None:
        """The stage's copies are done: its blocks are readable and addressable by hash."""
        with self._lock:
            for bid, copied in zip(st.ids, st.copy, strict=True):
                if not copied:
                    continue
                b = self._blocks[bid]
                b.ready = True
                assert b.hash is not None
                self._by_hash.setdefault(b.hash, bid)
                self.staged += 1

    # ---- restores: tier -> pool ----------------------------------------------------------

    def holds(self, h: bytes, tokens: np.ndarray) -> bool:
        with self._lock:
            return self._find(h, tokens) is not None

    def pin(self, h: bytes, tokens: np.ndarray) -> int | None:
        """The block holding exactly these tokens under this hash, pinned (None when not held)."""
        with self._lock:
            bid = self._find(h, tokens)
            if bid is not None:
                self._pin(bid)
            return bid

    def unpin(self, ids: list[int]) -> None:
        """Drop pins taken by `stage` or `pin`; a block no one pins joins the idle list, still addressable."""
        with self._lock:
            self._unpin_locked(ids)

    # ---- under the lock -------------------------------------------------------------------

    def _find(self, h: bytes, tokens: np.ndarray) -> int | None:
        bid = self._by_hash.get(h)
        if bid is None:
            return None
        b = self._blocks[bid]
        if not b.ready or b.tokens is None or not np.array_equal(b.tokens, tokens):
            return None
        return bid

    def _pin(self, bid: int) -> None:
        b = self._blocks[bid]
        if b.pins == 0:
            self._idle.pop(bid, None)
        b.pins += 1

    def _unpin_locked(self, ids: list[int]) -> None:
        for bid in ids:
            b = self._blocks[bid]
            b.pins -= 1
            if b.pins < 0:
                raise RuntimeError(f"tier block {bid} unpinned more than pinned")
            if b.pins == 0:
                if not b.ready:  # a stage that never finished: nothing in it is worth keeping
                    self._forget(bid)
                    self._idle[bid] = None
                    self._idle.move_to_end(bid, last=False)
                else:
                    self._idle[bid] = None

    def _forget(self, bid: int) -> None:
        b = self._blocks[bid]
        if b.hash is not None and self._by_hash.get(b.hash) == bid:
            del self._by_hash[b.hash]
        b.hash, b.tokens, b.ready = None, None, False
