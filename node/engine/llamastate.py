"""llama.cpp's per-sequence KV state blob: its layout, a check of one block, and cutting by position.

`llama_state_seq_get_data` (llama.cpp `src/llama-context.cpp` then `src/llama-kv-cache.cpp`
`state_write`) writes, for a unified cache (one stream):

    u32 magic 0xaf143cd8 | i32 source seq id (ignored on restore)
    u32 n_stream (1) | u32 cell_count
    per cell:   i32 pos | u32 n_seq_id (1) | [cell ext, 12 B, M-RoPE/PLE models only] | i32 seq_id
    u32 v_trans | u32 n_layer
    per layer:  i32 k_type | u64 k_row_bytes | cell_count rows of K
    V, row-wise (v_trans 0): per layer  i32 v_type | u64 v_row_bytes | cell_count rows of V
    V, transposed (v_trans 1): per layer  i32 v_type | u32 v_elem_bytes | u32 n_embd_v | n_embd_v x cell_count elements

A model with sliding-window layers (iSWA) has two caches, and its blob holds two such sections
after the magic and seq id, each from `n_stream` on: the full-attention layers', then the
window layers'. With `swa_full` both hold every position, so a block's blob has the same cells
in both sections; `Layout.extra` describes the sections after the first. A hybrid model's blob holds
its attention cache's section, then its recurrent state's (cell count, per cell pos and a zero
seq count, then per layer R and S rows: `llama_memory_recurrent::state_write`); a recurrent-only
model's (Mamba) holds the recurrent section alone, a layout of no attention layer.

Where a sequence resumes at a snapshot (node.engine.snapshots: window mode, recurrent state) a block
is `bare`: the first cache's section, then `tail`, the other caches' sections as they are with no
cell. The snapshot is `llama_state_seq_get_data_ext` with PARTIAL_ONLY: magic, seq id, then the
window section, or the recurrent one, alone (`check_snapshot`).

It is layer-major and in cell order, so a 256-position block is not a byte range of a
sequence's blob. A kvmesh block is the blob of a sequence holding exactly that block's
positions (cut with `llama_memory_seq_cp` to a scratch sequence, see `node.engine.llamacpp`):
its size depends only on the cell count, so every full block has the same size. This module
needs numpy only: `Layout` is learned from one probe blob, `check` tells a block that
`set_data` would refuse (or restore at the wrong positions) before it touches the cache, and
`cut`/`join` re-cut blobs by position (the alternative to the scratch sequence, measured in
the transfer bench).
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

import numpy as np

EXT_BYTES = 12  # llama_kv_cell_ext: x, y, tok (i32 each)
MAGIC = 0xAF143CD8  # llama-context.cpp io_magic
_SEQ_HEAD = 8  # magic, source seq id: then one section per cache, each from its n_stream
_H = _SEQ_HEAD + 8  # ... n_stream, cell_count: the first section's cell meta starts here


@dataclass(frozen=True)
class Layout:
    """The shape of this context's per-sequence blobs (all but the cell count)."""

    n_layer: int
    ext: bool
    v_trans: bool
    k: tuple[tuple[int, int], ...]  # per layer (ggml type, row bytes)
    v: tuple[tuple[int, int, int], ...]  # per layer (ggml type, row bytes or element bytes, n_embd_v (trans) else 0)
    extra: tuple[Layout, ...] = ()  # the caches after the first (iSWA: the window layers'), the same cells
    bare: bool = False  # a block carries the first cache only, then `tail`
    tail: bytes = b""  # bare blocks: the sections of the caches after the first, holding no cell
    recurrent: int = 0  # bytes of a model's recurrent section for one sequence (one cell); 0: none

    @property
    def cell_meta(self) -> int:
        return 12 + (EXT_BYTES if self.ext else 0)

    @property
    def sections(self) -> tuple[Layout, ...]:
        return (self, *self.extra)

    def section_size(self, cells: int) -> int:
        """Bytes of this cache's section (n_stream, cell count, cell meta, layers) for `cells` cells; none
        for a model without attention layers."""
        if not self.n_layer:
            return 0
        n = 8 + cells * self.cell_meta + 8
        n += sum(12 + cells * row for _, row in self.k)
        if self.v_trans:
            n += sum(12 + cells * el * emb for _, el, emb in self.v)
        else:
            n += sum(12 + cells * row for _, row, _ in self.v)
        return n

    def size(self, cells: int) -> int:
        """Bytes of a blob of `cells` cells."""
        if self.bare:
            return _SEQ_HEAD + self.section_size(cells) + len(self.tail)
        return _SEQ_HEAD + sum(sec.section_size(cells) for sec in self.sections)


def learn(blob: bytes | memoryview, n_layer: int, *, recurrent: bool = False) -> Layout:
    """Read a layout from a real blob of a one-position sequence (tries both cell-meta sizes); its
    sections' layers add up to the model's `n_layer`, or (recurrent) fewer, the recurrent section after
    them; a recurrent-only model's (Mamba) is that section alone: a layout of no attention layer."""
    mv = memoryview(blob).cast("B")
    magic, _, n_stream, cells = struct.unpack_from("<IiII", mv, 0)
    if magic == MAGIC and recurrent and n_stream == 1 and cells == 0:  # recurrent section: 1 cell, at position 0
        return Layout(0, False, False, (), (), recurrent=len(mv) - _SEQ_HEAD)
    if magic != MAGIC or n_stream != 1 or cells == 0:
        raise ValueError(f"a probe blob (magic {magic:#x}) of {n_stream} streams and {cells} cells: "
                         "kvmesh needs llama.cpp's sequence state of one stream (kv_unified)")
    for ext in (False, True):
        sections: list[Layout] = []
        off = _SEQ_HEAD
        while off < len(mv) and (sec := _read_section(mv, off, cells, ext)) is not None:
            sections.append(sec)
            off += sec.section_size(cells)
        attn = sum(sec.n_layer for sec in sections)
        if sections and (off == len(mv) and attn == n_layer or recurrent and off < len(mv) and attn < n_layer):
            return dataclasses.replace(sections[0], extra=tuple(sections[1:]), recurrent=len(mv) - off)
    raise ValueError("the probe blob does not parse as llama.cpp's per-sequence state")


def _read_section(mv: memoryview, off: int, cells: int, ext: bool) -> Layout | None:
    """One cache's section at `off` (from its n_stream), or None where it does not parse as one."""
    try:
        n_stream, n = struct.unpack_from("<II", mv, off)
        meta_end = off + 8 + cells * (12 + (EXT_BYTES if ext else 0))
        v_trans, nl = struct.unpack_from("<II", mv, meta_end)
        if n_stream != 1 or n != cells or v_trans not in (0, 1) or nl == 0:
            return None
        return _read_layers(mv, meta_end + 8, cells, nl, bool(v_trans), ext)
    except (struct.error, ValueError):
        return None


def _read_layers(mv: memoryview, off: int, cells: int, nl: int, v_trans: bool, ext: bool) -> Layout:
    k: list[tuple[int, int]] = []
    for _ in range(nl):
        t, row = struct.unpack_from("<iQ", mv, off)
        k.append((t, row))
        off += 12 + cells * row
    v: list[tuple[int, int, int]] = []
    for _ in range(nl):
        if v_trans:
            t, el, emb = struct.unpack_from("<iII", mv, off)
            v.append((t, el, emb))
            off += 12 + cells * el * emb
        else:
            t, row = struct.unpack_from("<iQ", mv, off)
            v.append((t, row, 0))
            off += 12 + cells * row
        if off > len(mv):
            raise ValueError("truncated")
    return Layout(nl, ext, v_trans, tuple(k), tuple(v))


def _positions(mv: memoryview, cells: int, lay: Layout, at: int = _H) -> np.ndarray:
    meta = np.frombuffer(mv, dtype=np.uint8, count=cells * lay.cell_meta, offset=at).reshape(cells, lay.cell_meta)
    return meta[:, :4].copy().view("<i4").reshape(-1)


def check(blob: bytes | memoryview, lay: Layout, first_pos: int, cells: int) -> str | None:
    """Why `set_data` of this block blob would fail or restore the wrong thing; None if it is sound.

    Checks the header, the per-layer types and row sizes against this context's, that the cells
    of every cache section hold exactly positions first_pos..first_pos+cells-1, and the total size."""
    mv = memoryview(blob).cast("B")
    need = lay.size(cells)
    if len(mv) < need:
        return f"{len(mv)} bytes, a block of {cells} cells is {need}"
    (magic,) = struct.unpack_from("<I", mv, 0)
    if magic != MAGIC:
        return f"magic {magic:#x}; expected llama.cpp's"
    off = _SEQ_HEAD
    for k, sec in enumerate(lay.sections if lay.n_layer else ()):
        if k and lay.bare:
            break
        why = _check_section(mv, off, sec, first_pos, cells)
        if why is not None:
            return why if k == 0 else f"cache section {k + 1}: {why}"
        off += sec.section_size(cells)
    if lay.bare and bytes(mv[off : off + len(lay.tail)]) != lay.tail:
        return "the caches after the first hold cells; a block resumed with a snapshot carries the first cache only"
    return None


def _check_section(mv: memoryview, off: int, sec: Layout, first_pos: int, cells: int) -> str | None:
    n_stream, n = struct.unpack_from("<II", mv, off)
    if n_stream != 1 or n != cells:
        return f"{n_stream} streams of {n} cells; expected 1 stream of {cells}"
    meta = np.frombuffer(mv, dtype=np.uint8, count=cells * sec.cell_meta, offset=off + 8).reshape(cells, sec.cell_meta)
    n_seq = meta[:, 4:8].copy().view("<u4").reshape(-1)
    if (n_seq != 1).any():
        return "a cell belongs to more than one sequence"
    pos = _positions(mv, cells, sec, off + 8)
    if not np.array_equal(np.sort(pos), np.arange(first_pos, first_pos + cells, dtype=np.int32)):
        return f"cells hold positions {int(pos.min())}..{int(pos.max())}, not {first_pos}..{first_pos + cells - 1}"
    meta_end = off + 8 + cells * sec.cell_meta
    try:
        got = _read_layers(mv, meta_end + 8, cells, sec.n_layer, sec.v_trans, sec.ext)
    except (struct.error, ValueError):
        return "the per-layer headers are truncated"
    v_trans, nl = struct.unpack_from("<II", mv, meta_end)
    if (bool(v_trans), nl) != (sec.v_trans, sec.n_layer) or (got.k, got.v, got.ext) != (sec.k, sec.v, sec.ext):
        return "its K/V types, row sizes or V layout are not this context's"
    return None


def bare_block(blob: np.ndarray, lay: Layout, cells: int, out: np.ndarray) -> int:
    """Write into `out` the bare block of a whole state `blob` of `cells` cells: its header and first
    cache's section as they are, the later caches' sections empty. Returns its size."""
    (n,) = struct.unpack_from("<I", blob.data, 12) if lay.n_layer else (cells,)
    if n != cells:
        raise ValueError(f"the state holds {n} cells of its first cache, not {cells}")
    head = _SEQ_HEAD + lay.section_size(cells)
    out[:head] = blob[:head]
    out[head : head + len(lay.tail)] = np.frombuffer(lay.tail, dtype=np.uint8)
    return head + len(lay.tail)


def check_snapshot(blob: bytes | memoryview, lay: Layout, pos: int, n_swa: int) -> str | None:
    """Why a snapshot must not be restored at `pos`; None when it holds exactly the window cache's cells for
    positions [pos - min(pos, n_swa), pos), or a recurrent state after position pos - 1, in this
    context's types and sizes."""
    mv = memoryview(blob).cast("B")
    if lay.recurrent:
        if len(mv) != _SEQ_HEAD + lay.recurrent or pos < 1:
            return f"{len(mv)} bytes; a recurrent state snapshot is {_SEQ_HEAD + lay.recurrent}"
        magic, _, cells, at, n_seq = struct.unpack_from("<IiIiI", mv, 0)
        if magic != MAGIC or cells != 1 or n_seq != 0:
            return "not llama.cpp's recurrent state of one sequence"
        return None if at == pos - 1 else f"the recurrent state stands after position {at}, not {pos - 1}"
    if not lay.extra:
        return "this model has one cache: it takes no snapshot"
    if pos < 1:
        return f"a window snapshot at position {pos}: it needs at least one position"
    cells = min(pos, n_swa)  # the window cells not masked for the next position
    if len(mv) != (want := _SEQ_HEAD + lay.extra[0].section_size(cells)):
        return f"{len(mv)} bytes; a window snapshot at position {pos} is {want}"
    if struct.unpack_from("<I", mv, 0)[0] != MAGIC:
        return "not llama.cpp's sequence state"
    why = _check_section(mv, _SEQ_HEAD, lay.extra[0], pos - cells, cells)
    return None if why is None else f"window snapshot: {why}"


def _sections(mv: memoryview, cells: int, lay: Layout) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Views of a blob: the cell meta [cells, meta], per layer K [cells, row], V [cells, row] or [emb, cells, el]."""
    buf = np.frombuffer(mv, dtype=np.uint8)
    meta = buf[_H : _H + cells * lay.cell_meta].reshape(cells, lay.cell_meta)
    off = _H + cells * lay.cell_meta + 8
    ks: list[np.ndarray] = []
    vs: list[np.ndarray] = []
    for _, row in lay.k:
        ks.append(buf[off + 12 : off + 12 + cells * row].reshape(cells, row))
        off += 12 + cells * row
    for _, a, emb in lay.v:
        if lay.v_trans:
            vs.append(buf[off + 12 : off + 12 + cells * a * emb].reshape(emb, cells, a))
            off += 12 + cells * a * emb
        else:
            vs.append(buf[off + 12 : off + 12 + cells * a].reshape(cells, a))
            off += 12 + cells * a
    return meta, ks, vs


def _write(out: np.ndarray, lay: Layout, meta: np.ndarray, ks: list[np.ndarray], vs: list[np.ndarray]) -> int:
    """Write a blob of len(meta) cells from its sections into `out`; returns its size."""
    cells = len(meta)
    mv = memoryview(out).cast("B")  # type: ignore[arg-type]  # ndarrays are buffers; numpy's stubs disagree
    struct.pack_into("<IiII", mv, 0, MAGIC, 0, 1, cells)
    off = _H
    out[off : off + meta.size] = meta.reshape(-1)
    off += meta.size
    struct.pack_into("<II", mv, off, int(lay.v_trans), lay.n_layer)
    off += 8
    for (t, row), k in zip(lay.k, ks):
        struct.pack_into("<iQ", mv, off, t, row)
        out[off + 12 : off + 12 + k.size].reshape(k.shape)[...] = k
        off += 12 + k.size
    for (t, a, emb), v in zip(lay.v, vs):
        if lay.v_trans:
            struct.pack_into("<iII", mv, off, t, a, emb)
        else:
            struct.pack_into("<iQ", mv, off, t, a)
        out[off + 12 : off + 12 + v.size].reshape(v.shape)[...] = v
        off += 12 + v.size
    return off


def one_stream(blob: np.ndarray, seq: int) -> np.ndarray:
    """Sequence `seq`'s state from a context of one KV stream per sequence (not kv_unified), in the
    one-stream form (`n_stream` 1) blocks use. Such a blob has n_stream sections, each a cell count
    and, for the sequence's own stream only, its cells: the others are empty (count 0, 4 bytes)."""
    magic, _, n_stream = struct.unpack_from("<IiI", blob.data, 0)
    if magic != MAGIC or not 0 <= seq < n_stream:
        raise ValueError(f"a state of {n_stream} streams (magic {magic:#x}) does not hold sequence {seq}'s stream")
    lo, hi = 12 + 4 * seq, len(blob) - 4 * (n_stream - 1 - seq)
    others = np.concatenate([blob[12:lo], blob[hi:]]).view("<u4") if n_stream > 1 else np.zeros(0, dtype="<u4")
    if (others != 0).any():
        raise ValueError("another stream of the state holds cells: not one sequence's state")
    out = np.empty(8 + 4 + (hi - lo), dtype=np.uint8)
    out[:8] = blob[:8]
    out[8:12] = np.frombuffer(struct.pack("<I", 1), dtype=np.uint8)
    out[12:] = blob[lo:hi]
    return out


def to_streams(buf: np.ndarray, size: int, n_stream: int) -> int:
    """Turn the one-stream blob in buf[:size] into the form a context of `n_stream` streams reads (its
    cells first, then n_stream - 1 empty streams: llama.cpp restores them into the target sequence's own
    stream); buf needs 4 * (n_stream - 1) spare bytes. Returns the new size."""
    struct.pack_into("<I", buf.data, 8, n_stream)
    pad = 4 * (n_stream - 1)
    buf[size : size + pad] = 0
    return size + pad


def _one_cache(lay: Layout) -> None:
    if lay.extra:
        raise ValueError("re-cutting by parsing handles one cache section (not a sliding-window model's two)")


def cut(blob: bytes | memoryview, lay: Layout, p0: int, p1: int, out: np.ndarray) -> int:
    """Write into `out` the blob of the cells of `blob` at positions [p0, p1), in position order.

    The parse-and-re-cut alternative to a scratch sequence: one gather per layer."""
    _one_cache(lay)
    mv = memoryview(blob).cast("B")
    (cells,) = struct.unpack_from("<I", mv, 12)
    pos = _positions(mv, cells, lay)
    sel = np.flatnonzero((pos >= p0) & (pos < p1))
    sel = sel[np.argsort(pos[sel], kind="stable")]
    meta, ks, vs = _sections(mv, cells, lay)
    return _write(out, lay, meta[sel], [k[sel] for k in ks], [v[:, sel] if lay.v_trans else v[sel] for v in vs])


def join(blobs: list[memoryview], lay: Layout, cells: list[int], out: np.ndarray) -> int:
    """Write into `out` one blob holding the cells of every blob in order (re-composed import)."""
    _one_cache(lay)
    parts = [_sections(memoryview(b).cast("B"), c, lay) for b, c in zip(blobs, cells)]
    meta = np.concatenate([p[0] for p in parts])
    ks = [np.concatenate([p[1][i] for p in parts]) for i in range(lay.n_layer)]
    axis = 1 if lay.v_trans else 0
    vs = [np.concatenate([p[2][i] for p in parts], axis=axis) for i in range(len(lay.v))]
    return _write(out, lay, meta, ks, vs)
