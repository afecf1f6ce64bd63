"""The llama.cpp back end: GGUF models in-process (llama-cpp-python's low-level API) under the Engine.

The Engine keeps its block bookkeeping (pool, chained hashes, pins, LRU, export, import);
`LlamaRunner` is its `Runner`, as `TorchRunner` and `SimRunner` are:
- one llama.cpp context, one sequence per slot, `n_ctx` = slots x the per-slot context;
- each slot's sequence in a KV stream of its own (llama-server's default), so a slot's attention
  reads only its own cells. A block's bytes are llama.cpp's per-sequence state of its positions
  (`node.engine.llamastate`): `store` reads the slot's whole state once per commit and cuts each
  new block from it by position (`llamastate.cut`); `load` checks every block, joins them into one
  state (`llamastate.join`) and restores it into the slot's stream in one `set_data`;
- a sliding-window model's two caches keep one unified stream (`kv_unified`) and a scratch
  sequence (id `slots`): a block is cut by sharing its positions with the scratch sequence
  (`llama_memory_seq_cp` shares cells) and writing the scratch's state; a restore goes through
  the scratch block by block and hands its cells to the slot (`seq_cp`);
- in window mode (`swa = "window"`) such a model's window layers keep their last window only, and a
  recurrent state (hybrid or Mamba models) exists only where its sequence ends: a block is bare (the
  attention cache alone, if any), and a sequence resumes at a snapshot of the rest
  (`node.engine.snapshots`), from its blocks or, on the slot that holds it, from its own attention
  cache. These keep the unified stream too;
- a block that does not check or does not restore leaves the slot's sequence erased and raises
  `RestoreFailed`: never half-restored (`node.engine.llamarestore`, restores and snapshots);
- prefill runs in chunks of `n_batch`; running slots decode ahead on the compute thread, every
  running slot in every `llama_decode` (node.engine.batcher);
- every llama.cpp call runs on one compute thread (a context is not thread-safe; and llama.cpp's
  OpenMP team belongs to the thread that computes), never on the event loop.

The model itself (loading, digest, fingerprint) is `node.engine.llamamodel`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
from typing import Any

import numpy as np
import torch

from kvmesh.node.config import LlamaCppConfig
from kvmesh.node.engine import llamaprobe, llamastate
from kvmesh.node.engine.batcher import DecodeBatcher, DecodeStep
from kvmesh.node.engine.blocks import BlockPool
from kvmesh.node.engine.compute import ComputeThread
from kvmesh.node.engine.llamamodel import LlamaModel, llama_error
from kvmesh.node.engine.llamarestore import Held, RestoreFailed, Restorer
from kvmesh.node.engine.snapshots import Snapshots
from kvmesh.node.engine.tailshapes import DECODE, Shapes

log = logging.getLogger("kvmesh.engine")


class LlamaRunner:
    """llama.cpp under the Engine: one sequence per slot, blocks as per-sequence state (module docstring)."""

    def __init__(self, model: LlamaModel, cfg: LlamaCppConfig, *, slots: int, max_context: int, block_size: int,
                 exact_tail: bool = False):
        """`exact_tail`: keep a slot's own cells past its last full block where that computes what whole blocks
        would (node.engine.tailshapes), if this context's kernels allow it (`exact_tail` then says why not)."""
        self.model, self.lib, self.cfg = model, model.lib, cfg
        self.slots, self.block_size, self.max_context = slots, block_size, max_context
        # torch only samples here. Its own OpenMP team, spinning after each op on the event loop's
        # thread, took cores from llama.cpp's: decode ran at 0.6x of llama-server's (bench engine).
        torch.set_num_threads(1)
        # A slot's sequence in a stream of its own (llama-server's default): attention reads only its own
        # cells. In one unified stream every slot's cells are in every slot's attention range: three idle
        # 7k-token sessions halved a fourth's prefill and decode (measured). Blocks are then cut from, and
        # joined into, the sequence's whole state (llamastate.cut/join). A sliding-window model's two
        # caches keep the unified stream and a scratch sequence blocks pass through (seq_cp shares cells).
        self.streams = model.n_swa == 0 and not model.recurrent
        # A sequence resumes at a snapshot of its window layers' last window, or of its recurrent state.
        self.snapshotted = model.n_swa > 0 and cfg.swa == "window" or model.recurrent
        self.partial = getattr(self.lib, "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY", 1)
        self.scratch = slots  # unified only: the extra sequence blocks pass through
        self._whole: tuple[int, np.ndarray] | None = None  # (slot, its one-stream state) until the slot changes
        self.ctx = llamaprobe.new_context(self)
        self.mem = self.lib.llama_get_memory(self.ctx)
        self.batch = self.lib.llama_batch_init(cfg.n_batch, 0, 1)
        self.held = [Held() for _ in range(slots)]
        self.pool: BlockPool | None = None  # attached by the Engine once it sized the pool from block_bytes
        self._exec = ComputeThread("kvmesh-llama")
        self.decoder = DecodeBatcher(self._exec, self._decode_batch, on_error=self._erase_slots)
        self.restored_blocks = 0  # blocks restored from the pool (a slot that still held them restores none)
        self.restorer = Restorer(self)  # blocks and snapshots into a slot's sequence (node.engine.llamarestore)
        # On the compute thread like every other decode: llama.cpp's OpenMP team belongs to the thread that
        # first computes, and a second team left idle on the main thread cost a third of decode speed here.
        # A state kvmesh cannot read is served with live caches (node.engine.live): no layout, a state size per token.
        self._layout: llamastate.Layout | None = None
        self.inexact: str | None = None  # why this model's state cannot be cut into blocks, or None
        try:
            self._layout = self._exec.submit(llamaprobe.layout, self).result()
        except ValueError as e:
            self.inexact = f"kvmesh cannot read its llama.cpp sequence state ({e})"
            self.snapshotted = False  # nothing to resume a snapshot on
        if self._layout is not None:
            self.block_bytes = self._layout.size(block_size)
            self.kv_bytes_per_token = -(-self.block_bytes // block_size)
        else:
            self.kv_bytes_per_token = self._exec.submit(llamaprobe.growth, self, self.ctx).result()
            self.block_bytes = self.kv_bytes_per_token * block_size
        n_ubatch = min(cfg.n_ubatch, cfg.n_batch)
        self.shapes = Shapes(block_size, cfg.n_batch, n_ubatch, llamaprobe.large_from(cfg.flash_attn, cfg.type_k, cfg.type_v))
        self.exact_tail: str | None = (
            "engine.reuse_tail is set" if not exact_tail
            else "its cache resumes at snapshots, not at any position" if self.snapshotted
            else "it keeps no blocks" if self.inexact
            else self._exec.submit(llamaprobe.tail_reason, self, self.shapes).result())
        self.settled = 0  # cells turns' ends recomputed so that the next turn keeps them (tailshapes.settle)

        self.snapshots = (Snapshots(cfg.snapshot_mib << 20, self.restorer.check_snapshot, block_size=block_size)
                          if self.snapshotted else None)

    @property
    def layout(self) -> llamastate.Layout:
        if self._layout is None:
            raise RuntimeError(f"{self.model.path.name} keeps no blocks: {self.inexact}")
        return self._layout

    def held_tokens(self, slot: int) -> np.ndarray:
        """The tokens whose KV (and recurrent state) the slot's sequence holds now."""
        return self.held[slot].tokens

    def held_kinds(self, slot: int) -> np.ndarray:
        """How each of those cells was computed (node.engine.tailshapes)."""
        return self.held[slot].kinds

    def _state(self, seq: int) -> np.ndarray:
        """The sequence's whole state in the one-stream form blocks use (`llamastate.one_stream`)."""
        size = self.lib.llama_state_seq_get_size(self.ctx, seq)
        buf = np.empty(size, dtype=np.uint8)
        n = self.lib.llama_state_seq_get_data(self.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq)
        return llamastate.one_stream(buf[:n], seq) if self.streams else buf[:n]

    def attach(self, pool: BlockPool) -> None:
        if pool.block_bytes != self.block_bytes or pool.device.type != "cpu":
            raise ValueError(f"a pool of {pool.block_bytes}-byte blocks on {pool.device}; llama.cpp blocks are {self.block_bytes} bytes in host memory")
        self.pool = pool

    def ptr(self, block_id: int) -> Any:
        assert self.pool is not None
        return ctypes.cast(self.pool.raw.data_ptr() + block_id * self.block_bytes, ctypes.POINTER(ctypes.c_uint8))

    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    def idle(self) -> bool:
        """Nothing for the compute thread to do: no job (a load, a prefill, a store, a decode batch, a settle)
        waits for it or runs on it, and no slot is decoding. Read from any thread (a settle's timer)."""
        return self._exec.idle() and self.decoder.idle()

    # ---- compute (compute thread only) ---------------------------------------------------

    def _decode(self, tokens: list[int] | np.ndarray, seqs: list[int], pos: list[int] | np.ndarray, *,
                logits_last: bool, logits_all: bool = False, pad: int = 0) -> None:
        """One llama_decode of len(tokens) tokens (<= n_batch); logits for the last, or for all. The last `pad` are
        padding (tailshapes): `logits_last` flags the one before them."""
        b, n = self.batch, len(tokens)
        np.ctypeslib.as_array(b.token, shape=(n,))[:] = tokens
        np.ctypeslib.as_array(b.pos, shape=(n,))[:] = pos
        np.ctypeslib.as_array(b.n_seq_id, shape=(n,))[:] = 1
        lg = np.ctypeslib.as_array(b.logits, shape=(n,))
        lg[:] = 1 if logits_all else 0
        if logits_last:
            lg[n - 1 - pad] = 1
        for i, s in enumerate(seqs if len(seqs) == n else [seqs[0]] * n):
            b.seq_id[i][0] = s
        b.n_tokens = n
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} ({'no room in the KV cache' if rc == 1 else 'error'}): "
                               f"{llama_error()}")

    def _logits(self, i: int) -> torch.Tensor:
        ptr = self.lib.llama_get_logits_ith(self.ctx, i)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy())

    def _prefill(self, slot: int, tokens: np.ndarray, start: int, logits: bool = True) -> torch.Tensor | None:
        held = self.held[slot]
        if held.n != start:
            raise RuntimeError(f"slot {slot} holds {held.n} tokens; a forward at {start} does not follow them")
        self._changed(slot)
        end = start + len(tokens)
        # The prompt's last block boundary is a checkpoint (snapshots): a ubatch ends there for its snapshot.
        mark = end // self.block_size * self.block_size if self.snapshotted else 0
        try:
            # One llama_decode per ubatch, on the grid from the block boundary (tailshapes: the kinds of cells).
            lo = start
            for hi in self.shapes.edges(start, end, mark):
                part = tokens[lo - start : hi - start]
                # An exact-tail first ubatch is padded to the kind every host computes it in (tailshapes);
                # never past the sequence's room, where every host is short of it alike.
                pad = min(self.shapes.pad(start, end), self.max_context - hi) if lo == start and self.exact_tail is None else 0
                if pad > 0:
                    part = np.concatenate([part, np.full(pad, part[-1], dtype=np.int32)])
                self._decode(part, [slot], np.arange(lo, hi + pad), logits_last=logits and hi == end, pad=max(pad, 0))
                if pad > 0 and not self.lib.llama_memory_seq_rm(self.mem, slot, hi, -1):
                    raise RuntimeError("llama.cpp could not drop a padded ubatch's padding")
                held.extend(tokens[lo - start : hi - start], self.shapes.kind(len(part)))
                if hi == mark:
                    self.restorer.snapshot(slot)
                lo = hi
        except BaseException:
            self.erase(slot)  # never a sequence that holds part of a chunk
            raise
        return self._logits(-1) if logits else None

    def erase(self, slot: int) -> None:
        self._changed(slot)
        self.lib.llama_memory_seq_rm(self.mem, slot, -1, -1)
        if not self.streams:
            self.lib.llama_memory_seq_rm(self.mem, self.scratch, -1, -1)
        self.held[slot].n = 0

    # ---- Runner interface ------------------------------------------------------------------

    async def load(self, slot: int, block_ids: list[int], tokens: np.ndarray) -> int:
        return await self._run(self._load, slot, block_ids, np.ascontiguousarray(tokens, dtype=np.int32))  # type: ignore[no-any-return]

    def _load(self, slot: int, block_ids: list[int], tokens: np.ndarray) -> int:
        """Make the slot's sequence hold exactly the KV of `tokens` (from these pool blocks); returns how many
        it holds, fewer only in window mode, where a sequence resumes at a snapshot of its window.

        Where the sequence already holds those tokens (this slot ran the session last), it is
        only trimmed: the pool's blocks were cut from it. Otherwise each block is restored."""
        n, held = len(tokens), self.held[slot]
        self._changed(slot)
        own = held.n >= n and np.array_equal(held.tokens[:n], tokens)
        if not own and not self.snapshotted:
            n = min(n, len(block_ids) * self.block_size)  # a slot's own tail is kept, never restored
            tokens = tokens[:n]
        if self.snapshotted and n:
            return self.restorer.from_snapshot(slot, block_ids, tokens, own)
        if own:
            if held.n > n and not self.lib.llama_memory_seq_rm(self.mem, slot, n, -1):
                self.erase(slot)
                raise RestoreFailed(0, "llama.cpp could not trim the sequence")
            held.n = n
            return n
        self.erase(slot)
        if self.streams:
            self.restorer.restore_joined(slot, block_ids, n)
        else:
            for j, bid in enumerate(block_ids):
                self.restorer.restore_block(slot, j, bid, min(self.block_size, n - j * self.block_size))
        if self.lib.llama_memory_seq_pos_max(self.mem, slot) >= n and not self.lib.llama_memory_seq_rm(self.mem, slot, n, -1):
            self.erase(slot)
            raise RestoreFailed(len(block_ids) - 1, "llama.cpp could not trim the last block")
        held.set(tokens)
        return n

    async def forward(self, slot: int, tokens: np.ndarray, start: int) -> torch.Tensor:
        # One token joins the running decode batch, except where the slot keeps exact cells (tailshapes): a whole
        # cached prompt recomputes its last cell, inside a block the pool holds, in the kind its prefill made it.
        if len(tokens) == 1 and start > 0 and self.exact_tail is not None:
            return await self.decoder.step(slot, int(tokens[0]), start)
        return await self._run(self._prefill, slot, np.ascontiguousarray(tokens, dtype=np.int32), start)  # type: ignore[no-any-return]

    def settle(self, slot: int, n: int, floor: int) -> concurrent.futures.Future[int]:
        """Recompute, on the compute thread, the cells of the slot's last partial block the next turn would
        recompute, as one batch (tailshapes.settle); the slot first drops what it decoded past its `n` committed
        tokens. The future's result: the cells recomputed."""
        return self._exec.submit(self._settle, slot, n, floor)

    def _settle(self, slot: int, n: int, floor: int) -> int:
        held = self.held[slot]
        if held.n > n and self.lib.llama_memory_seq_rm(self.mem, slot, n, -1):
            self._changed(slot)
            held.n = n
        span = self.shapes.settle(held.kinds, held.n, floor) if held.n == n else None
        if span is None:
            return 0
        lo, hi = span
        redo = held.tokens[lo:hi].copy()
        self._changed(slot)
        if not self.lib.llama_memory_seq_rm(self.mem, slot, lo, -1):
            self.erase(slot)
            return 0
        held.n = lo
        self._prefill(slot, redo, lo, logits=False)  # erases the slot if it fails: a later turn recomputes
        self.settled += hi - lo
        return hi - lo

    def _decode_batch(self, steps: list[DecodeStep]) -> list[torch.Tensor]:
        """Compute thread: every pending decode step (one per running slot) in one llama_decode."""
        for st in steps:
            if self.held[st.slot].n != st.pos:
                raise RuntimeError(f"slot {st.slot} holds {self.held[st.slot].n} tokens; a step at {st.pos} does not follow them")
            self._changed(st.slot)
        self._decode([st.token for st in steps], [st.slot for st in steps], [st.pos for st in steps],
                     logits_last=False, logits_all=True)
        rows = []
        for i, st in enumerate(steps):
            self.held[st.slot].extend(np.array([st.token], dtype=np.int32), DECODE)
            rows.append(self._logits(i))
            if self.snapshotted and self.held[st.slot].n % self.block_size == 0:
                self.restorer.snapshot(st.slot)  # a block boundary the reply crossed: a checkpoint as well
        return rows

    def _erase_slots(self, steps: list[DecodeStep]) -> None:
        for st in steps:  # a failed batch leaves no slot of it half-advanced
            self.erase(st.slot)

    async def store(self, slot: int, block_id: int, block_index: int, block_hash: bytes | None) -> None:
        await self._run(self._store, slot, block_id, block_index)

    def _store(self, slot: int, block_id: int, j: int) -> None:
        """Cut block j of the slot's sequence into pool block `block_id`: its positions shared with
        the scratch sequence (no KV copied), the scratch's state written straight into the pool."""
        p0 = j * self.block_size
        p1 = min(p0 + self.block_size, self.held[slot].n)
        if p1 <= p0:
            raise RuntimeError(f"slot {slot} holds no token of block {j}")
        if self.streams:
            n = self._cut(slot, block_id, p0, p1)
            if n != self.layout.size(p1 - p0):
                raise RuntimeError(f"block {j} of slot {slot}: {n} bytes of state, expected {self.layout.size(p1 - p0)}")
            return
        self.lib.llama_memory_seq_cp(self.mem, slot, self.scratch, p0, p1)
        try:
            if self.snapshotted:  # the attention cache alone: the rest travels in snapshots
                out = np.ctypeslib.as_array(self.ptr(block_id), shape=(self.block_bytes,))
                n = llamastate.bare_block(self._state(self.scratch), self.layout, p1 - p0, out)
            else:
                n = self.lib.llama_state_seq_get_data(self.ctx, self.ptr(block_id), self.block_bytes, self.scratch)
        finally:
            self.lib.llama_memory_seq_rm(self.mem, self.scratch, -1, -1)
        if n != self.layout.size(p1 - p0):
            raise RuntimeError(f"block {j} of slot {slot}: {n} bytes of state, expected {self.layout.size(p1 - p0)}")

    def _cut(self, slot: int, block_id: int, p0: int, p1: int) -> int:
        """Positions [p0, p1) of the slot's state into the pool block. A commit stores its new blocks
        one after another: the sequence's state is read once and kept until it changes."""
        if self._whole is None or self._whole[0] != slot:
            self._whole = None  # the old one is freed before the new one is read
            self._whole = (slot, self._state(slot))
        out = np.ctypeslib.as_array(self.ptr(block_id), shape=(self.block_bytes,))
        return llamastate.cut(self._whole[1].data, self.layout, p0, p1, out)

    def _changed(self, slot: int) -> None:
        """The slot's sequence is about to change: a state kept for cutting it is stale."""
        if self._whole is not None and self._whole[0] == slot:
            self._whole = None

    def close(self) -> None:
        self._exec.shutdown(wait=True, cancel_futures=True)
        self.decoder.cancel_pending()
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None
        self.model.close()
