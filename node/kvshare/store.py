"""The on-disk replica store: KV blocks of sessions, kept across restarts.

A replica is a session's whole blocks: tokens, chained hashes, payload digests
and the KV payloads. Each session has one directory, named by the digest of its
id (`protocol.session_key`: 32 hex digits, whatever the id holds: '/', '..',
non-ASCII); the id itself is in the manifest::

    root/<key>/manifest.json      the commit point; names the session and every other file
    root/<key>/tokens-<seq>.bin   int32 LE token ids of every stored block
    root/<key>/seg-<seq>.kv       one delta: payloads of a contiguous run of
                                  blocks, back to back from offset 0

A directory named by the id itself (the format before session keys) is renamed
to its key when the store opens.

Every file is written under a temporary name (starting with "~", which a session
key cannot), renamed once complete, and only becomes part of the replica
when a new manifest.json naming it replaces the old one by rename. So a torn or
corrupt write never becomes visible: until that last rename, readers see the
previous replica; after a crash the next start deletes the leftovers.

With fsync="always" each file is fsynced before its rename and the directory
after, so a replica that was visible survives power loss; "never" leaves that to
the page cache. The store holds a host's received replicas and its own sessions
alike: each write appends one delta segment to what is held (or, when the
prefix diverges, keeps the common blocks and drops the rest). Segments are
compacted into one when there are many.

The store is safe to use from several threads: short index operations take one
lock, commits (the disk work) are serialised by another. One process owns a
root at a time.

Reads map segment files. At most `max_open_maps` mappings are open across the
whole store (least recently used closed first), so open files do not grow with
the sessions held. A mapping is never closed under a view a caller still holds:
it is dropped from the store and unmapped when the last such view goes. Mapped
pages a read touched count in the process's RSS while mapped; once views worth
`trim_bytes` were handed out, every open mapping is told the pages are not
needed (MADV_DONTNEED: a later read faults them back in from the page cache).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import re
import shutil
import threading
import time
import uuid
import warnings
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Annotated, Literal, cast

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvmesh.node.engine.hashing import (
    HASH_BYTES,
    TOKEN_DTYPE,
    as_tokens,
    block_hashes,
    chain_seed,
    payload_digest,
)
from kvmesh.node.errors import ImportRefused, KVMeshError
from kvmesh.node.kvshare.wire import check_session_id
from kvmesh.node.protocol import is_valid_session_id, session_key

if TYPE_CHECKING:
    from kvmesh.node.engine.boundary import EngineAPI, ImportAPI

log = logging.getLogger("kvmesh.kvshare.store")

FsyncPolicy = Literal["always", "never"]
MANIFEST = "manifest.json"
TEMP_PREFIX = "~"
MAX_SEGMENTS = 16
MAX_OPEN_MAPS = 64  # mapped segment files open at once, across the store
TRIM_BYTES = 4 << 20  # bytes of views handed out between two MADV_DONTNEED passes
_KEY_RE = re.compile(r"[0-9a-f]{32}")  # a session directory's name: protocol.session_key
_wall_clock = time.time  # stamps a manifest's "updated" (LRU order after a restart); swappable in tests


class StoreError(KVMeshError):
    """A replica store operation was refused; `reason` says which check failed."""

    status = 409
    code = "replica_store_error"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Segment:
    """One segment file: payloads of blocks first..first+count-1."""

    file: str
    first: int
    count: int

    @property
    def end(self) -> int:
        return self.first + self.count


@dataclass(frozen=True, eq=False)
class Manifest:
    """What the store holds of one session (tokens are read-only)."""

    session: str
    fingerprint: str
    block_size: int
    block_bytes: int
    tokens: np.ndarray
    hashes: list[bytes]
    digests: list[bytes]
    generation: int
    updated: float
    segments: tuple[Segment, ...] = ()
    seq: int = 0
    tokens_file: str = ""

    @property
    def n_blocks(self) -> int:
        return len(self.hashes)

    @property
    def num_tokens(self) -> int:
        return self.n_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """KV payload bytes held (segment files; tokens and manifest not counted)."""
        return self.n_blocks * self.block_bytes

    def segment_of(self, i: int) -> Segment:
        k = bisect_right([s.first for s in self.segments], i) - 1
        return self.segments[k]


# ---- manifest.json ----------------------------------------------------------------

_Hex16 = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class _SegmentModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    file: str = Field(pattern=r"^seg-[0-9]{1,20}\.kv$")
    first: int = Field(ge=0)
    count: int = Field(ge=1)


class _ManifestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: Literal[1]
    session: str
    fingerprint: str
    block_size: int = Field(ge=1)
    block_bytes: int = Field(ge=1)
    generation: int = Field(ge=0)
    updated: float
    seq: int = Field(ge=0)
    tokens_file: str = Field(pattern=r"^tokens-[0-9]{1,20}\.bin$")
    hashes: list[_Hex16]
    digests: list[_Hex16]
    segments: list[_SegmentModel]


def _manifest_json(m: Manifest) -> bytes:
    model = _ManifestModel(
        format=1,
        session=m.session,
        fingerprint=m.fingerprint,
        block_size=m.block_size,
        block_bytes=m.block_bytes,
        generation=m.generation,
        updated=m.updated,
        seq=m.seq,
        tokens_file=m.tokens_file,
        hashes=[h.hex() for h in m.hashes],
        digests=[d.hex() for d in m.digests],
        segments=[_SegmentModel(file=s.file, first=s.first, count=s.count) for s in m.segments],
    )
    return model.model_dump_json().encode()


def _readonly(tokens: np.ndarray) -> np.ndarray:
    tokens.flags.writeable = False
    return tokens


# ---- files ---------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(what: str) -> str:
    return f"{TEMP_PREFIX}{what}.{uuid.uuid4().hex}.tmp"


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _write_file(directory: Path, name: str, data: bytes | memoryview, fsync: bool) -> None:
    """Write `data` as `name` in `directory`: temp file, fsync (optional), rename."""
    tmp = directory / _temp_name(name)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _bytes_of(data: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    mv = memoryview(cast("bytes", data))  # numpy arrays are buffers too; the stubs disagree
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


# ---- the index ----------------------------------------------------------------------------


@dataclass
class _Entry:
    manifest: Manifest
    disk_bytes: int
    verified: bytearray  # 1 = payload digest checked since this process loaded it
    # Which replica of the session this is: a new one after an eviction (file names start over),
    # the same across the deltas written to it. Open mappings are keyed by it.
    incarnation: int = 0


class _Corrupt(Exception):
    """A session directory that cannot be trusted; the message says why."""


def _close_map(mm: mmap.mmap) -> bool:
    """Unmap now; False when a caller still holds a view of it.

    Such a mapping stays valid for that view: the view holds the only reference
    left, and the mapping (and its file descriptor) is released when it goes."""
    try:
        mm.close()
    except BufferError:
        return False
    return True


_MADV_DONTNEED: int | None = getattr(mmap, "MADV_DONTNEED", None)


def _trim_map(mm: mmap.mmap) -> None:
    """Drop the pages of a read-only file mapping from this process (they stay in the page cache)."""
    if _MADV_DONTNEED is not None:
        with contextlib.suppress(OSError, ValueError):  # ValueError: closed meanwhile
            mm.madvise(_MADV_DONTNEED)


class ReplicaStore:
    """Replicas of sessions on disk, under a byte budget, least recently used evicted first."""

    def __init__(
        self,
        root: str | Path,
        budget_bytes: int,
        fsync: FsyncPolicy = "always",
        *,
        max_open_maps: int = MAX_OPEN_MAPS,
        trim_bytes: int = TRIM_BYTES,
    ) -> None:
        if fsync not in ("always", "never"):
            raise ValueError(f"fsync must be 'always' or 'never', not {fsync!r}")
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        if max_open_maps < 1:
            raise ValueError("max_open_maps must be >= 1")
        if trim_bytes < 0:
            raise ValueError("trim_bytes must be >= 0 (0: never trim)")
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.fsync: FsyncPolicy = fsync
        self.evictions = 0
        # Called with the session id after a budget or explicit eviction (any thread).
        self.on_evict: Callable[[str], None] | None = None
        self.dropped = 0  # sessions removed because their files were corrupt
        self._lock = threading.RLock()  # the index
        self._commit_lock = threading.RLock()  # disk changes: commits and evictions
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        # Open segment mappings, (session, file) -> map, least recently used first; under _lock.
        self.max_open_maps = max_open_maps
        self.trim_bytes = trim_bytes
        self._maps: OrderedDict[tuple[str, int, str], mmap.mmap] = OrderedDict()
        self._incarnations = itertools.count(1)
        self._viewed = 0  # bytes of views handed out since the last trim
        self.maps_deferred = 0  # mappings dropped while a caller still held a view (released with it)
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()
        with self._commit_lock:
            self._enforce_budget(keep=None)

    # ---- queries ---------------------------------------------------------------

    def sessions(self) -> list[str]:
        """Held sessions, least recently used first."""
        with self._lock:
            return list(self._entries)

    def manifest(self, session: str) -> Manifest | None:
        check_session_id(session)
        with self._lock:
            entry = self._entries.get(session)
            return entry.manifest if entry else None

    def held_prefix_blocks(self, session: str, fingerprint: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` this store holds for the session."""
        m = self.manifest(session)
        if m is None or m.fingerprint != fingerprint:
            return 0
        return self._common(m.hashes, hashes)

    def usage_bytes(self) -> int:
        """Bytes on disk of every held session (segments, tokens, manifests)."""
        with self._lock:
            return sum(e.disk_bytes for e in self._entries.values())

    def open_maps(self) -> int:
        """Segment mappings the store holds open now (never more than `max_open_maps`)."""
        with self._lock:
            return len(self._maps)

    def touch(self, session: str) -> None:
        """Mark the session used now (it becomes the last to be evicted)."""
        check_session_id(session)
        with self._lock:
            if session in self._entries:
                self._entries.move_to_end(session)

    def block_view(self, session: str, i: int, *, verify: bool = False) -> memoryview:
        """Read-only view of block i's payload, mapped from its segment.

        With verify=True its payload digest is checked first (once per process, as
        `import_into` does); a corrupt block drops the session and raises StoreError('digest').
        """
        check_session_id(session)
        with self._lock:
            entry = self._entries.get(session)
            if entry is None:
                raise StoreError(f"no replica of session {session!r}", reason="missing")
            view = self._view(entry, i)
        if verify and not self._verify(entry, i, view):
            raise StoreError(f"replica of {session!r}: block {i} on disk is corrupt (digest mismatch)", reason="digest")
        return view

    # ---- writing ----------------------------------------------------------------

    def begin_write(
        self,
        session: str,
        *,
        fingerprint: str,
        block_size: int,
        block_bytes: int,
        tokens: np.ndarray,
        hashes: Sequence[bytes],
        first_block: int,
        generation: int,
    ) -> SegmentWriter:
        """Start writing blocks first_block..len(hashes)-1 of a replica; blocks before it are kept."""
        check_session_id(session)
        hashes = [bytes(h) for h in hashes]
        toks = self._checked_tokens(fingerprint, block_size, block_bytes, tokens, hashes, first_block)
        need = len(hashes) * block_bytes + toks.nbytes
        if need > self.budget_bytes:
            raise StoreError(f"a replica of {need} bytes does not fit the store's budget of {self.budget_bytes}", reason="no_room")
        with self._lock:
            entry = self._entries.get(session)
            base = entry.manifest if entry else None
            self._check_prefix(session, base, fingerprint, block_size, block_bytes, hashes, first_block)
            keep, seg_first = self._plan(base, first_block)
            carry = [self._view(entry, i) for i in range(seg_first, first_block)] if entry else []
            # Under the same lock as _forget_empty_dir, so an aborted first write cannot remove it now.
            directory = self._dir(session)
            fresh = not directory.exists()
            directory.mkdir(exist_ok=True)
            if fresh and self.fsync == "always":
                _fsync_dir(self.root)
            writer = SegmentWriter(
                self, session, fingerprint=fingerprint, block_size=block_size, block_bytes=block_bytes, tokens=toks,
                hashes=hashes, first_block=first_block, generation=generation, base=base, keep=keep, seg_first=seg_first,
            )  # fmt: skip
        try:
            if entry is not None:
                for k, view in enumerate(carry):
                    i = seg_first + k
                    if not self._verify(entry, i, view):
                        raise StoreError(f"held block {i} of {session!r} is corrupt: write from block 0", reason="corrupt")
                    writer._append(view, entry.manifest.digests[i])
        except BaseException:
            writer.abort()
            raise
        finally:
            if carry:  # copied into the new segment: the pages read need not stay in RSS
                with self._lock:
                    self._trim_maps_of(session)
        return writer

    def _checked_tokens(
        self, fingerprint: str, block_size: int, block_bytes: int, tokens: np.ndarray, hashes: list[bytes], first_block: int
    ) -> np.ndarray:
        n = len(hashes)
        if block_size < 1 or block_bytes < 1:
            raise StoreError(f"block_size {block_size} and block_bytes {block_bytes} must be positive", reason="shape")
        if any(len(h) != HASH_BYTES for h in hashes):
            raise StoreError("every block hash must be 16 bytes", reason="shape")
        if not 0 <= first_block <= n:
            raise StoreError(f"first_block {first_block} is outside 0..{n}", reason="shape")
        toks = as_tokens(tokens)
        if len(toks) < n * block_size:
            raise StoreError(f"{len(toks)} tokens do not fill {n} blocks of {block_size}", reason="shape")
        toks = _readonly(toks[: n * block_size].copy())
        if block_hashes(chain_seed(fingerprint), toks, block_size) != hashes:
            raise StoreError("block hashes do not match the hash chain of the tokens", reason="hash_chain")
        return toks

    @staticmethod
    def _check_prefix(
        session: str, base: Manifest | None, fingerprint: str, block_size: int, block_bytes: int, hashes: list[bytes], first_block: int
    ) -> None:
        """Blocks before first_block must be held already, under the same hashes."""
        if first_block == 0:
            return
        if base is None:
            raise StoreError(f"first_block {first_block}, but no replica of {session!r} is held", reason="prefix")
        if (base.fingerprint, base.block_size, base.block_bytes) != (fingerprint, block_size, block_bytes):
            raise StoreError(f"the held replica of {session!r} is another model or block shape: write from block 0", reason="prefix")
        if base.n_blocks < first_block or base.hashes[:first_block] != hashes[:first_block]:
            held = ReplicaStore._common(base.hashes, hashes)
            raise StoreError(f"first_block {first_block}, but only {held} leading blocks of {session!r} match", reason="prefix")

    @staticmethod
    def _common(a: Sequence[bytes], b: Sequence[bytes]) -> int:
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n

    @staticmethod
    def _plan(base: Manifest | None, first_block: int) -> tuple[tuple[Segment, ...], int]:
        """Segments kept as they are, and where the new segment starts (before first_block
        when a kept segment would be cut, or 0 to compact many segments into one)."""
        if base is None or first_block == 0:
            return (), first_block
        keep = tuple(s for s in base.segments if s.end <= first_block)
        cut = [s for s in base.segments if s.first < first_block < s.end]
        seg_first = cut[0].first if cut else first_block
        if len(keep) >= MAX_SEGMENTS - 1:
            return (), 0
        return keep, seg_first

    def _commit(self, w: SegmentWriter) -> Manifest:
        if w.next_index != w.n_blocks:
            raise StoreError(f"commit with blocks {w.next_index}..{w.n_blocks - 1} of {w.session!r} not written", reason="incomplete")
        with self._commit_lock:
            with self._lock:
                entry = self._entries.get(w.session)
            base_seq = w.base.seq if w.base else None
            if (entry.manifest.seq if entry else None) != base_seq:
                w.abort()
                raise StoreError(f"the replica of {w.session!r} changed while this write was in progress", reason="conflict")
            try:
                manifest = self._write_manifest(w, (base_seq or 0) + 1)
            except OSError as e:
                w.abort()
                raise StoreError(f"writing the replica of {w.session!r} failed: {e}", reason="io") from e
            self._install(w, manifest)
            self._enforce_budget(keep=w.session)
        return manifest

    def _write_manifest(self, w: SegmentWriter, seq: int) -> Manifest:
        """Rename the segment into place, write tokens, then the manifest (the commit point)."""
        d = self._dir(w.session)
        sync = self.fsync == "always"
        segments = list(w.keep)
        written: list[Path] = []
        try:
            if w._tmp is not None:
                name = f"seg-{seq:08d}.kv"
                w._close(sync)
                os.replace(w._tmp, d / name)
                w._tmp = None
                written.append(d / name)
                segments.append(Segment(name, w.seg_first, w.n_blocks - w.seg_first))
            tokens_file = f"tokens-{seq:08d}.bin"
            _write_file(d, tokens_file, _bytes_of(w.tokens), sync)
            written.append(d / tokens_file)
            if sync:
                _fsync_dir(d)  # the segment and tokens names are durable before the manifest names them
            digests = list(w.base.digests[: w.seg_first]) if w.base else []
            manifest = Manifest(
                w.session, w.fingerprint, w.block_size, w.block_bytes, w.tokens, w.hashes, digests + w._digests,
                w.generation, _wall_clock(), tuple(segments), seq, tokens_file,
            )  # fmt: skip
            _write_file(d, MANIFEST, _manifest_json(manifest), sync)
            if sync:
                _fsync_dir(d)
        except BaseException:
            for p in written:
                _unlink_quietly(p)
            raise
        w._committed = True
        return manifest

    def _install(self, w: SegmentWriter, manifest: Manifest) -> None:
        """Swap the new manifest into the index; delete the files it no longer names."""
        d = self._dir(w.session)
        live = {s.file for s in manifest.segments} | {manifest.tokens_file}
        verified = bytearray(manifest.n_blocks)
        with self._lock:
            old = self._entries.get(w.session)
            if old is not None:
                verified[: w.seg_first] = old.verified[: w.seg_first]
                self._close_maps_of(w.session, keep=live)
            verified[w.seg_first :] = b"\x01" * (manifest.n_blocks - w.seg_first)  # checked as they were written
            incarnation = old.incarnation if old is not None else next(self._incarnations)
            self._entries[w.session] = _Entry(manifest, self._disk_bytes(d, manifest), verified, incarnation)
            self._entries.move_to_end(w.session)
        if w.base is not None:
            for f in {s.file for s in w.base.segments} | {w.base.tokens_file}:
                if f not in live:
                    _unlink_quietly(d / f)

    @staticmethod
    def _disk_bytes(d: Path, m: Manifest) -> int:
        with contextlib.suppress(OSError):
            return m.nbytes + m.num_tokens * TOKEN_DTYPE.itemsize + (d / MANIFEST).stat().st_size
        return m.nbytes + m.num_tokens * TOKEN_DTYPE.itemsize

    # ---- import into an engine ------------------------------------------------------

    def import_into(self, engine: EngineAPI, session: str, *, upto_blocks: int | None = None) -> int:
        """Import the session's replica (or its first `upto_blocks`) into `engine`; returns tokens resident.

        Only blocks the engine lacks are copied, each straight from the mapped
        segment into the engine's pool, each payload digest checked once per
        process. Any failure aborts the engine's import: it gets nothing.
        All in the calling thread: an event loop uses `begin_import` instead.
        """
        imp = self.begin_import(engine, session, upto_blocks=upto_blocks)
        if imp is None:
            return 0
        try:
            imp.copy()
            return imp.txn.commit()
        except BaseException:
            imp.txn.abort()
            raise

    def begin_import(self, engine: EngineAPI, session: str, *, upto_blocks: int | None = None) -> StoreImport | None:
        """Reserve the engine's blocks for the session's replica (or its first `upto_blocks`); None when
        there is nothing to import. Call it where the engine's bookkeeping lives (its event loop); then
        `copy()` on any thread, then `txn.commit()` or `txn.abort()` back where it began."""
        check_session_id(session)
        with self._lock:
            entry = self._entries.get(session)
            if entry is None:
                raise StoreError(f"no replica of session {session!r}", reason="missing")
            self._entries.move_to_end(session)
        m = entry.manifest
        n = m.n_blocks if upto_blocks is None else max(0, min(upto_blocks, m.n_blocks))
        if n == 0:
            return None
        txn = engine.begin_import(session, m.fingerprint, m.tokens[: n * m.block_size], m.hashes[:n])
        return StoreImport(self, entry, txn)

    def _verify(self, entry: _Entry, i: int, view: memoryview) -> bool:
        """Block i's payload digest, checked once per process; a mismatch drops the session."""
        if entry.verified[i]:
            return True
        m = entry.manifest
        if payload_digest(view) != m.digests[i]:
            self._drop(m.session, f"block {i} on disk failed its payload digest check")
            return False
        entry.verified[i] = 1
        return True

    def _view(self, entry: _Entry, i: int) -> memoryview:
        """Block i's payload, mapped from its segment (the caller holds _lock)."""
        m = entry.manifest
        if not 0 <= i < m.n_blocks:
            raise IndexError(f"block {i} of {m.session!r}: the replica has {m.n_blocks} blocks")
        seg = m.segment_of(i)
        mm = self._map(entry, seg.file)
        if self.trim_bytes:
            self._viewed += m.block_bytes
            if self._viewed >= self.trim_bytes:
                self._trim()
        lo = (i - seg.first) * m.block_bytes
        return memoryview(mm)[lo : lo + m.block_bytes]

    def _map(self, entry: _Entry, file: str) -> mmap.mmap:
        """The open mapping of one of the entry's segment files, opened (and the least recently
        used one closed) as needed."""
        session = entry.manifest.session
        key = (session, entry.incarnation, file)
        mm = self._maps.get(key)
        if mm is not None:
            self._maps.move_to_end(key)
            return mm
        current = self._entries.get(session)
        if current is None or current.incarnation != entry.incarnation:
            # Evicted since the caller looked it up: the path may name another replica's file by now.
            raise StoreError(f"the replica of {session!r} was evicted during the read", reason="missing")
        path = self._dir(session) / file
        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise StoreError(f"segment {file} of {session!r} cannot be read: {e}", reason="missing") from e
        self._maps[key] = mm
        while len(self._maps) > self.max_open_maps:
            _, old = self._maps.popitem(last=False)
            self._release_map(old)
        return mm

    def _release_map(self, mm: mmap.mmap) -> None:
        if not _close_map(mm):
            # A view of it is still in use (a sender, an import): it lives until that view goes.
            _trim_map(mm)
            self.maps_deferred += 1

    def _close_maps_of(self, session: str, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """Close the session's mappings, but those of the files in `keep` (the caller holds _lock)."""
        for key in [k for k in self._maps if k[0] == session and k[2] not in keep]:
            self._release_map(self._maps.pop(key))

    def _trim_maps_of(self, session: str) -> None:
        for (s, _, _), mm in self._maps.items():
            if s == session:
                _trim_map(mm)

    def _trim(self) -> None:
        """Drop the mapped pages reads touched from RSS (the caller holds _lock); views stay valid."""
        self._viewed = 0
        for mm in self._maps.values():
            _trim_map(mm)

    # ---- eviction ----------------------------------------------------------------------

    def evict(self, session: str) -> None:
        """Delete the session's replica (no-op when none is held)."""
        check_session_id(session)
        with self._commit_lock:
            if self._remove(session):
                self.evictions += 1
                self._evicted(session)

    def _evicted(self, session: str) -> None:
        if self.on_evict is not None:
            self.on_evict(session)

    def _drop(self, session: str, why: str) -> None:
        log.warning("dropping the replica of session %r: %s", session, why)
        with self._commit_lock:
            if self._remove(session):
                self.dropped += 1

    def _remove(self, session: str) -> bool:
        with self._lock:
            entry = self._entries.pop(session, None)
            if entry is None:
                return False
            self._close_maps_of(session)
        self._rmtree(self._dir(session))
        return True

    def _enforce_budget(self, keep: str | None) -> None:
        """Evict least recently used sessions (never `keep`) until usage fits the budget."""
        while self.usage_bytes() > self.budget_bytes:
            with self._lock:
                victim = next((s for s in self._entries if s != keep), None)
            if victim is None:
                return
            log.info("evicting the replica of session %r: over the %d-byte budget", victim, self.budget_bytes)
            self._remove(victim)
            self.evictions += 1
            self._evicted(victim)

    def _rmtree(self, path: Path) -> None:
        """Make the directory vanish at once (rename), then delete it."""
        trash = self.root / _temp_name("trash")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def _forget_empty_dir(self, session: str) -> None:
        """An aborted first write leaves no directory behind."""
        with self._lock:
            if session not in self._entries:
                with contextlib.suppress(OSError):
                    os.rmdir(self._dir(session))

    def close(self) -> None:
        """Release mapped segments (views still held elsewhere stay valid)."""
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
            self._viewed = 0
            for mm in maps:
                self._release_map(mm)

    # ---- start-up ----------------------------------------------------------------------

    def _dir(self, session: str) -> Path:
        return self.root / session_key(session)

    def _scan(self) -> None:
        """Index what is on disk; delete temp leftovers; drop sessions that do not check out."""
        found: list[_Entry] = []
        for path in sorted(self.root.iterdir()):
            name = path.name
            if name.startswith(TEMP_PREFIX):
                log.info("removing leftover %s", path)
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    _unlink_quietly(path)
                continue
            if path.is_dir() and not _KEY_RE.fullmatch(name):
                path = self._rename_legacy(path) or path
            if not path.is_dir() or not _KEY_RE.fullmatch(path.name):
                log.warning("ignoring %s: not a replica directory", path)
                continue
            try:
                found.append(self._load(path))
            except _Corrupt as e:
                log.warning("dropping the replica in %s/: %s", path.name, e)
                self.dropped += 1
                self._rmtree(path)
        for entry in sorted(found, key=lambda e: e.manifest.updated):
            self._entries[entry.manifest.session] = entry

    def _rename_legacy(self, path: Path) -> Path | None:
        """A directory named by the session id itself (before session keys): renamed to its key
        when its manifest names that very session and the key is free; None otherwise."""
        try:
            session = _ManifestModel.model_validate_json((path / MANIFEST).read_bytes()).session
        except (OSError, ValidationError):
            return None
        target = self._dir(session)
        if session != path.name or not is_valid_session_id(session) or target.exists():
            return None
        os.rename(path, target)
        log.info("renamed the replica directory of %r to its key %s", session, target.name)
        return target

    def _load(self, d: Path) -> _Entry:
        for p in d.iterdir():
            if p.name.startswith(TEMP_PREFIX):
                log.info("removing leftover %s", p)
                _unlink_quietly(p)
        try:
            raw = (d / MANIFEST).read_bytes()
        except FileNotFoundError:
            raise _Corrupt("no manifest.json (a first write that never committed)") from None
        try:
            model = _ManifestModel.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors()[0]
            raise _Corrupt(f"manifest.json does not parse ({'.'.join(map(str, first['loc']))}: {first['msg']})") from None
        m = self._from_model(d, model)
        self._check_files(d, m)
        live = {s.file for s in m.segments} | {m.tokens_file, MANIFEST}
        for p in d.iterdir():
            if p.name not in live:
                log.info("removing %s: no manifest names it", p)
                _unlink_quietly(p)
        return _Entry(m, m.nbytes + m.num_tokens * TOKEN_DTYPE.itemsize + len(raw), bytearray(m.n_blocks),
                      next(self._incarnations))

    @staticmethod
    def _from_model(d: Path, model: _ManifestModel) -> Manifest:
        if not is_valid_session_id(model.session) or session_key(model.session) != d.name:
            raise _Corrupt(f"manifest.json names session {model.session!r}, whose key is not {d.name}")
        n = len(model.hashes)
        if len(model.digests) != n:
            raise _Corrupt(f"{n} hashes but {len(model.digests)} digests")
        end = 0
        for s in model.segments:
            if s.first != end:
                raise _Corrupt(f"segment {s.file} starts at block {s.first}, not {end}")
            end += s.count
        if end != n:
            raise _Corrupt(f"segments hold {end} blocks, the manifest lists {n}")
        path = d / model.tokens_file
        want = n * model.block_size * TOKEN_DTYPE.itemsize
        if not path.is_file() or path.stat().st_size != want:
            raise _Corrupt(f"{model.tokens_file} is missing or not {want} bytes")
        tokens = _readonly(np.fromfile(path, dtype=TOKEN_DTYPE))
        hashes = [bytes.fromhex(h) for h in model.hashes]
        if block_hashes(chain_seed(model.fingerprint), tokens, model.block_size) != hashes:
            raise _Corrupt("the token ids do not match the block hashes")
        return Manifest(
            model.session, model.fingerprint, model.block_size, model.block_bytes, tokens, hashes,
            [bytes.fromhex(x) for x in model.digests], model.generation, model.updated,
            tuple(Segment(s.file, s.first, s.count) for s in model.segments), model.seq, model.tokens_file,
        )  # fmt: skip

    @staticmethod
    def _check_files(d: Path, m: Manifest) -> None:
        for s in m.segments:
            path = d / s.file
            want = s.count * m.block_bytes
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise _Corrupt(f"segment {s.file} is missing") from None
            if size != want:
                raise _Corrupt(f"segment {s.file} is {size} bytes, not {want}")


class ImportCancelled(ImportRefused):
    """A store import was told to stop before it copied every block."""

    def __init__(self, session: str) -> None:
        super().__init__(f"the import of {session!r} from the store was cancelled", reason="cancelled")


@dataclass
class StoreImport:
    """A store -> engine import whose blocks are reserved (`ReplicaStore.begin_import`).

    `copy()` is the bulk byte work (page-cache reads, digests, copies into the pool) and
    may run on a worker thread: the reserved blocks are the txn's alone until it commits
    or aborts, which happens back on the engine's thread once `copy()` has returned.
    """

    store: ReplicaStore
    entry: _Entry
    txn: ImportAPI

    @property
    def session(self) -> str:
        return self.entry.manifest.session

    def copy(self, cancel: threading.Event | None = None) -> None:
        """Copy every block the engine lacks, checking each payload digest (once per process).
        Raises ImportRefused('digest') on a corrupt block, ImportCancelled once `cancel` is set."""
        store, entry, session = self.store, self.entry, self.session
        try:
            for i in self.txn.missing:
                if cancel is not None and cancel.is_set():
                    raise ImportCancelled(session)
                with store._lock:
                    view = store._view(entry, i)
                if not store._verify(entry, i, view):
                    raise ImportRefused(f"replica of {session!r}: block {i} on disk is corrupt (digest mismatch)", reason="digest")
                copy_block(self.txn, i, view)
        finally:
            # The engine has its copy now: the mapped pages need not count in this process's RSS.
            with store._lock:
                store._trim_maps_of(session)


def copy_bytes(dst: memoryview, src: memoryview | bytes | np.ndarray) -> None:
    """dst[:] = src through numpy, which lets go of the GIL while it copies (a memoryview
    assignment holds it throughout: an event loop in another thread would wait for the copy)."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))  # type: ignore[arg-type]  # buffers


def copy_block(txn: ImportAPI, i: int, view: memoryview) -> None:
    """One memcpy from the page cache into the engine's pool block."""
    try:
        dst = txn.buffer(i)
    except RuntimeError:
        dst = None  # an accelerator pool: the engine copies host -> device
    if dst is not None:
        if len(view) != len(dst):
            raise ImportRefused(f"block {i} is {len(view)} bytes; the engine's blocks are {len(dst)}", reason="size")
        copy_bytes(dst, view)
        return
    with warnings.catch_warnings():
        # torch warns that the mapped source is read-only; it only reads it.
        warnings.simplefilter("ignore", UserWarning)
        txn.write(i, view)


class SegmentWriter:
    """One delta being written: blocks arrive in order, then `commit()` or `abort()`."""

    def __init__(
        self,
        store: ReplicaStore,
        session: str,
        *,
        fingerprint: str,
        block_size: int,
        block_bytes: int,
        tokens: np.ndarray,
        hashes: list[bytes],
        first_block: int,
        generation: int,
        base: Manifest | None,
        keep: tuple[Segment, ...],
        seg_first: int,
    ) -> None:
        self._store = store
        self.session = session
        self.fingerprint, self.block_size, self.block_bytes = fingerprint, block_size, block_bytes
        self.tokens, self.hashes = tokens, hashes
        self.first_block, self.generation = first_block, generation
        self.n_blocks = len(hashes)
        self.base, self.keep, self.seg_first = base, keep, seg_first
        self._digests: list[bytes] = []
        self._next = seg_first
        self._committed = False
        self._aborted = False
        self._tmp: Path | None = None
        self._file = None
        if seg_first < self.n_blocks:
            self._tmp = store._dir(session) / _temp_name("seg")
            self._file = open(self._tmp, "xb")  # noqa: SIM115 - closed in _close/abort

    @property
    def next_index(self) -> int:
        return self._next

    def write_block(self, i: int, data: memoryview | bytes | np.ndarray, digest: bytes) -> None:
        """Append block i (the next one) after checking its payload against `digest`."""
        self._check_open()
        if i != self._next or i >= self.n_blocks:
            raise StoreError(f"block {i} written out of order; next is {self._next} of {self.n_blocks}", reason="order")
        view = _bytes_of(data)
        if len(view) != self.block_bytes:
            raise StoreError(f"block {i} is {len(view)} bytes, not {self.block_bytes}", reason="shape")
        if payload_digest(view) != digest:
            raise StoreError(f"block {i}'s payload does not match its digest", reason="digest")
        self._append(view, bytes(digest))

    def _append(self, view: memoryview, digest: bytes) -> None:
        assert self._file is not None
        self._file.write(view)
        self._digests.append(digest)
        self._next += 1

    def commit(self) -> Manifest:
        """Make the replica visible (all blocks written and verified): fsync, rename, new manifest."""
        self._check_open()
        return self._store._commit(self)

    def abort(self) -> None:
        """Remove the temp file; nothing of this write becomes visible. Idempotent."""
        if self._committed or self._aborted:
            return
        self._aborted = True
        try:
            if self._file is not None:
                f, self._file = self._file, None
                with contextlib.suppress(OSError):  # closing flushes a buffered tail: ENOSPC again, say
                    f.close()
        finally:
            if self._tmp is not None:
                _unlink_quietly(self._tmp)
                self._tmp = None
            self._store._forget_empty_dir(self.session)

    def _close(self, fsync: bool) -> None:
        if self._file is not None:
            self._file.flush()
            if fsync:
                os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def _check_open(self) -> None:
        if self._committed or self._aborted:
            raise StoreError(f"this write of {self.session!r} is already {'committed' if self._committed else 'aborted'}", reason="state")

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        # Leaving the block without a commit (an exception, or just forgetting) writes nothing.
        self.abort()
