"""Segment files: one delta's KV payloads, back to back from offset 0.

`SegmentWriter` appends a delta's blocks to a temp file, each checked against its digest, takes
the state snapshot that goes with them (if any), and hands itself to the commit that renames it
into place. `SegmentMaps` holds the read-only
mappings reads are served from: at most `max_open` across the whole store, least recently
used closed first, never unmapped under a view a caller still holds (see `store`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections import OrderedDict
from collections.abc import Callable
from io import BufferedWriter
from pathlib import Path
from types import TracebackType

import numpy as np

from kvmesh.node.engine.hashing import payload_digest
from kvmesh.node.errors import KVMeshError
from kvmesh.node.kvshare.store.files import bytes_of, temp_name, unlink_quietly
from kvmesh.node.kvshare.store.manifest import Manifest, Segment

MAX_OPEN_MAPS = 64  # mapped segment files open at once, across the store
TRIM_BYTES = 4 << 20  # bytes of views handed out between two MADV_DONTNEED passes

# An open mapping: (session, incarnation of its replica, segment file name).
MapKey = tuple[str, int, str]


class StoreError(KVMeshError):
    """A replica store operation was refused; `reason` says which check failed."""

    status = 409
    code = "replica_store_error"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class SegmentWriter:
    """One delta being written: blocks arrive in order, then `commit()` or `abort()`."""

    def __init__(
        self,
        directory: Path,
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
        commit: Callable[[SegmentWriter], Manifest],
        aborted: Callable[[str], None],
    ) -> None:
        self.directory = directory
        self.session = session
        self.fingerprint, self.block_size, self.block_bytes = fingerprint, block_size, block_bytes
        self.tokens, self.hashes = tokens, hashes
        self.first_block, self.generation = first_block, generation
        self.n_blocks = len(hashes)
        self.base, self.keep, self.seg_first = base, keep, seg_first
        self._commit, self._aborted_hook = commit, aborted
        self._digests: list[bytes] = []
        self._next = seg_first
        self._committed = False
        self._aborted = False
        self._tmp: Path | None = None
        self._file: BufferedWriter | None = None
        self.snapshot: tuple[int, memoryview, bytes] | None = None  # (position, payload, digest), written at commit
        if seg_first < self.n_blocks:
            self._tmp = directory / temp_name("seg")
            self._file = open(self._tmp, "xb")  # noqa: SIM115 - closed in _close/abort

    @property
    def next_index(self) -> int:
        return self._next

    @property
    def digests(self) -> list[bytes]:
        """Payload digests of the blocks appended so far (from seg_first on)."""
        return self._digests

    def write_block(self, i: int, data: memoryview | bytes | np.ndarray, digest: bytes) -> None:
        """Append block i (the next one) after checking its payload against `digest`."""
        self._check_open()
        if i != self._next or i >= self.n_blocks:
            raise StoreError(f"block {i} written out of order; next is {self._next} of {self.n_blocks}", reason="order")
        view = bytes_of(data)
        if len(view) != self.block_bytes:
            raise StoreError(f"block {i} is {len(view)} bytes, not {self.block_bytes}", reason="shape")
        if payload_digest(view) != digest:
            raise StoreError(f"block {i}'s payload does not match its digest", reason="digest")
        self.append_held(view, bytes(digest))

    def set_snapshot(self, pos: int, data: memoryview | bytes | np.ndarray, digest: bytes) -> None:
        """The state snapshot at `pos` that goes with these blocks, after checking it against `digest`; it is
        written at commit (the caller keeps `data` unchanged until then)."""
        self._check_open()
        if pos < 1 or pos > self.n_blocks * self.block_size or pos % self.block_size:
            raise StoreError(f"a snapshot at {pos} is not at a block boundary of the {self.n_blocks} blocks", reason="shape")
        view = bytes_of(data)
        if payload_digest(view) != digest:
            raise StoreError(f"the snapshot at {pos} does not match its digest", reason="digest")
        self.snapshot = (pos, view, bytes(digest))

    def append_held(self, view: memoryview, digest: bytes) -> None:
        """Append the next block unchecked: a held block the caller verified against `digest`."""
        assert self._file is not None
        self._file.write(view)
        self._digests.append(digest)
        self._next += 1

    def commit(self) -> Manifest:
        """Make the replica visible (all blocks written and verified): fsync, rename, new manifest."""
        self._check_open()
        return self._commit(self)

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
                unlink_quietly(self._tmp)
                self._tmp = None
            self._aborted_hook(self.session)

    def place(self, name: str, fsync: bool) -> Segment | None:
        """Close the temp file and rename it to `name`: the new segment, or None when this
        write appends none (every block was kept)."""
        if self._tmp is None:
            return None
        self._close(fsync)
        os.replace(self._tmp, self.directory / name)
        self._tmp = None
        return Segment(name, self.seg_first, self.n_blocks - self.seg_first)

    def mark_committed(self) -> None:
        """The manifest naming this write is in place: abort() is a no-op from now on."""
        self._committed = True

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


# ---- reads: mapped segments ---------------------------------------------------------


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


class SegmentMaps:
    """Open segment mappings, least recently used first. Not locked itself: the index calls it
    under its lock."""

    def __init__(self, max_open: int, trim_bytes: int) -> None:
        self.max_open = max_open
        self.trim_bytes = trim_bytes
        self._maps: OrderedDict[MapKey, mmap.mmap] = OrderedDict()
        self._viewed = 0  # bytes of views handed out since the last trim
        self.deferred = 0  # mappings dropped while a caller still held a view (released with it)

    def __len__(self) -> int:
        return len(self._maps)

    def cached(self, key: MapKey) -> mmap.mmap | None:
        """The open mapping of `key`, now the most recently used; None when it is not open."""
        mm = self._maps.get(key)
        if mm is not None:
            self._maps.move_to_end(key)
        return mm

    def open(self, key: MapKey, path: Path) -> mmap.mmap:
        """Map `path` as `key`, closing the least recently used mapping beyond `max_open`."""
        session, _, file = key
        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise StoreError(f"segment {file} of {session!r} cannot be read: {e}", reason="missing") from e
        self._maps[key] = mm
        while len(self._maps) > self.max_open:
            _, old = self._maps.popitem(last=False)
            self._release(old)
        return mm

    def view(self, mm: mmap.mmap, lo: int, n: int) -> memoryview:
        """Bytes lo..lo+n-1 of the mapping; every `trim_bytes` handed out, a trim."""
        if self.trim_bytes:
            self._viewed += n
            if self._viewed >= self.trim_bytes:
                self.trim()
        return memoryview(mm)[lo : lo + n]

    def close_of(self, session: str, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """Close the session's mappings, but those of the files in `keep`."""
        for key in [k for k in self._maps if k[0] == session and k[2] not in keep]:
            self._release(self._maps.pop(key))

    def trim_of(self, session: str) -> None:
        for (s, _, _), mm in self._maps.items():
            if s == session:
                _trim_map(mm)

    def trim(self) -> None:
        """Drop the mapped pages reads touched from RSS; views stay valid."""
        self._viewed = 0
        for mm in self._maps.values():
            _trim_map(mm)

    def close(self) -> None:
        """Release every mapping (views still held elsewhere stay valid)."""
        maps = list(self._maps.values())
        self._maps.clear()
        self._viewed = 0
        for mm in maps:
            self._release(mm)

    def _release(self, mm: mmap.mmap) -> None:
        if not _close_map(mm):
            # A view of it is still in use (a sender, an import): it lives until that view goes.
            _trim_map(mm)
            self.deferred += 1
