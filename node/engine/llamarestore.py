"""KV state into a slot's llama.cpp sequence: pool blocks restored (each checked first), snapshots taken
and resumed (window mode, recurrent state: node.engine.snapshots).

`Restorer` works on the runner's context through `SequenceHost` (node.engine.llamacpp's `LlamaRunner` is
one), on its compute thread like every llama.cpp call. A block that does not check or does not restore
leaves the slot's sequence erased and raises `RestoreFailed`: never half-restored.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Protocol

import numpy as np

from kvmesh.node.engine import llamastate
from kvmesh.node.engine.blocks import BlockPool
from kvmesh.node.engine.llamamodel import LlamaModel, llama_error
from kvmesh.node.engine.snapshots import Snapshots
from kvmesh.node.engine.tailshapes import UNKNOWN

log = logging.getLogger("kvmesh.engine")


class RestoreFailed(RuntimeError):
    """A block's state did not restore; the slot's sequence is erased. `block`: its index."""

    def __init__(self, block: int, reason: str) -> None:
        super().__init__(f"block {block} did not restore: {reason}")
        self.block = block
        self.reason = reason


class Held:
    """The tokens whose KV a slot's llama.cpp sequence holds, in position order, and how each cell was
    computed (`node.engine.tailshapes` kinds: what a turn may keep of them token by token)."""

    def __init__(self) -> None:
        self.buf = np.empty(1024, dtype=np.int32)
        self.kind_buf = np.empty(1024, dtype=np.uint8)
        self.n = 0

    @property
    def tokens(self) -> np.ndarray:
        return self.buf[: self.n]

    @property
    def kinds(self) -> np.ndarray:
        return self.kind_buf[: self.n]

    def set(self, tokens: np.ndarray, kinds: np.ndarray | int = UNKNOWN) -> None:
        self.n = 0
        self.extend(tokens, kinds)

    def extend(self, tokens: np.ndarray, kinds: np.ndarray | int = UNKNOWN) -> None:
        need = self.n + len(tokens)
        if need > len(self.buf):
            size = max(need, 2 * len(self.buf))
            grown, grown_kinds = np.empty(size, dtype=np.int32), np.empty(size, dtype=np.uint8)
            grown[: self.n], grown_kinds[: self.n] = self.buf[: self.n], self.kind_buf[: self.n]
            self.buf, self.kind_buf = grown, grown_kinds
        self.buf[self.n : need] = tokens
        self.kind_buf[self.n : need] = kinds
        self.n = need


class SequenceHost(Protocol):
    """What a restore uses of the runner: its llama.cpp context and sequences, its pool, its snapshots."""

    lib: Any
    ctx: Any
    mem: Any
    model: LlamaModel
    held: list[Held]
    block_size: int
    slots: int
    scratch: int  # the sequence blocks pass through (unified stream only)
    partial: int  # llama.cpp's PARTIAL_ONLY flag: a snapshot's part of a sequence's state
    pool: BlockPool | None
    snapshots: Snapshots | None
    restored_blocks: int

    @property
    def layout(self) -> llamastate.Layout: ...

    def erase(self, slot: int) -> None: ...

    def ptr(self, block_id: int) -> Any: ...


class Restorer:
    """Blocks and snapshots into a slot's sequence (compute thread only)."""

    def __init__(self, runner: SequenceHost):
        self.r = runner

    def check_snapshot(self, blob: np.ndarray, pos: int) -> str | None:
        return llamastate.check_snapshot(blob.data, self.r.layout, pos, self.r.model.n_swa)

    def snapshot(self, slot: int) -> None:
        """Keep the slot's window cache or recurrent state as the snapshot at the position its sequence stands at."""
        assert self.r.snapshots is not None
        held = self.r.held[slot]
        try:  # a snapshot not taken costs a later turn some prefill, never this turn
            size = self.r.lib.llama_state_seq_get_size_ext(self.r.ctx, slot, self.r.partial)
            buf = np.empty(size, dtype=np.uint8)
            n = self.r.lib.llama_state_seq_get_data_ext(self.r.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                      size, slot, self.r.partial)
            why = self.r.snapshots.put(held.tokens.copy(), buf[:n])
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            log.warning("slot %d: no snapshot at position %d: %s", slot, held.n, why)

    def from_snapshot(self, slot: int, block_ids: list[int], tokens: np.ndarray, own: bool) -> int:
        """The slot's sequence at the newest snapshot `tokens` extend: its attention cache from the blocks
        before it (or, `own`, the slot's own, trimmed), the rest from the snapshot. Returns the tokens it
        holds then (0 where no snapshot fits: nothing is restored).

        The slot's own window cache is never kept: llama.cpp's window ring holds its cells out of position
        order, and attention summed in another order moved Gemma 3's logits by up to 1.5 against a moved
        session's (measured); restored from the same snapshot, both compute bit-identically."""
        assert self.r.snapshots is not None
        w = self.r.snapshots.newest(tokens)
        if w is None or not own:
            self.r.erase(slot)
        if w is None:
            return 0
        bs = self.r.block_size
        for j, bid in enumerate([] if own else block_ids[: -(-w.pos // bs)]):
            self.restore_block(slot, j, bid, min(bs, w.pos - j * bs))
        # The snapshot before the trim: llama.cpp cannot roll a recurrent state back, but once it stands at
        # w.pos the trim leaves it be and cuts the attention cache alone.
        ptr = w.blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if self.r.lib.llama_state_seq_set_data_ext(self.r.ctx, ptr, w.nbytes, slot, self.r.partial) != w.nbytes:
            self.r.erase(slot)
            self.r.snapshots.drop(w)
            log.warning("slot %d: the snapshot at %d did not restore (%s); recomputing", slot, w.pos, llama_error())
            return 0
        if not self.r.lib.llama_memory_seq_rm(self.r.mem, slot, w.pos, -1):
            self.r.erase(slot)
            raise RestoreFailed(w.pos // bs, "llama.cpp could not trim the sequence to the snapshot")
        self.r.held[slot].set(tokens[: w.pos])
        self.r.snapshots.restored += 1
        return w.pos

    def check_block(self, j: int, block_id: int, used: int) -> tuple[memoryview, int, str | None]:
        """Block j's bytes, its cell count, and why it must not be restored (None: sound)."""
        assert self.r.pool is not None
        view = self.r.pool.read_bytes(block_id)
        cells = int(np.frombuffer(view, dtype="<u4", count=4)[3]) if self.r.layout.n_layer else used  # no attention: no cells
        if cells < used:
            return view, cells, f"it holds {cells} cells, {used} are needed"
        return view, cells, llamastate.check(view, self.r.layout, j * self.r.block_size, cells)

    def restore_joined(self, slot: int, block_ids: list[int], n: int) -> None:
        """Every block checked, then joined into one state restored into the slot's own stream."""
        views, cells = [], []
        for j, bid in enumerate(block_ids):
            view, c, reason = self.check_block(j, bid, min(self.r.block_size, n - j * self.r.block_size))
            if reason is not None:
                self.r.erase(slot)
                raise RestoreFailed(j, reason)
            views.append(view)
            cells.append(c)
        if not views:
            return
        pad = 4 * (self.r.slots - 1)
        buf = np.empty(self.r.layout.size(sum(cells)) + pad, dtype=np.uint8)
        size = llamastate.join(views, self.r.layout, cells, buf)
        size = llamastate.to_streams(buf, size, self.r.slots)
        ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if self.r.lib.llama_state_seq_set_data(self.r.ctx, ptr, size, slot) != size:
            self.r.erase(slot)
            raise RestoreFailed(len(views) - 1, f"llama_state_seq_set_data refused it: {llama_error()}")
        self.r.restored_blocks += len(views)

    def restore_block(self, slot: int, j: int, block_id: int, used: int) -> None:
        """Block j's state into the scratch sequence, its cells handed to the slot's sequence."""
        view, cells, reason = self.check_block(j, block_id, used)
        if reason is None:
            size = self.r.layout.size(cells)
            if self.r.lib.llama_state_seq_set_data(self.r.ctx, self.r.ptr(block_id), size, self.r.scratch) != size:
                reason = f"llama_state_seq_set_data refused it: {llama_error()}"
        if reason is not None:
            self.r.erase(slot)
            raise RestoreFailed(j, reason)
        self.r.lib.llama_memory_seq_cp(self.r.mem, self.r.scratch, slot, -1, -1)
        self.r.lib.llama_memory_seq_rm(self.r.mem, self.r.scratch, -1, -1)
        self.r.restored_blocks += 1
