"""Writing a replica into the store: the checks before a write, the delta plan (which
segments are kept, where the new one starts), and the commit that makes it visible.

A commit renames the new segment into place, writes the tokens file and the snapshot (if the
write brought one), then manifest.json (the commit point), each under a temp name first; then it
swaps the new manifest into the index and deletes the files it no longer names. A write without
a snapshot keeps the held one while the blocks before it are kept as they were: a snapshot belongs
to the exact tokens before it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from kvmesh.node.engine.hashing import HASH_BYTES, as_tokens, block_hashes, chain_seed
from kvmesh.node.kvshare.store.files import bytes_of, fsync_dir, unlink_quietly, write_file
from kvmesh.node.kvshare.store.index import Entry, ReplicaIndex
from kvmesh.node.kvshare.store.manifest import (
    MANIFEST,
    Manifest,
    Segment,
    StoredSnapshot,
    common_prefix,
    manifest_json,
    readonly,
)
from kvmesh.node.kvshare.store.segment import SegmentWriter, StoreError

FsyncPolicy = Literal["always", "never"]
MAX_SEGMENTS = 16
_wall_clock = time.time  # stamps a manifest's "updated" (LRU order after a restart); swappable in tests


class ReplicaWrites:
    """Begins and commits the writes of replicas held by `index`, fsyncing per `fsync`."""

    def __init__(self, index: ReplicaIndex, fsync: FsyncPolicy) -> None:
        self._index = index
        self.fsync: FsyncPolicy = fsync

    def begin(
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
        index = self._index
        hashes = [bytes(h) for h in hashes]
        toks = _checked_tokens(fingerprint, block_size, block_bytes, tokens, hashes, first_block)
        need = len(hashes) * block_bytes + toks.nbytes
        if need > index.budget_bytes:
            raise StoreError(f"a replica of {need} bytes does not fit the store's budget of {index.budget_bytes}", reason="no_room")
        with index.lock:
            entry = index.entries.get(session)
            base = entry.manifest if entry else None
            _check_prefix(session, base, fingerprint, block_size, block_bytes, hashes, first_block)
            keep, seg_first = _plan(base, first_block)
            carry = [index.view(entry, i) for i in range(seg_first, first_block)] if entry else []
            # Under the same lock as forget_empty_dir, so an aborted first write cannot remove it now.
            directory = index.dir(session)
            fresh = not directory.exists()
            directory.mkdir(exist_ok=True)
            if fresh and self.fsync == "always":
                fsync_dir(index.root)
            writer = SegmentWriter(
                directory, session, fingerprint=fingerprint, block_size=block_size, block_bytes=block_bytes, tokens=toks,
                hashes=hashes, first_block=first_block, generation=generation, base=base, keep=keep, seg_first=seg_first,
                commit=self._commit, aborted=index.forget_empty_dir,
            )  # fmt: skip
        try:
            if entry is not None:
                self._carry(entry, writer, carry)
        except BaseException:
            writer.abort()
            raise
        finally:
            if carry:  # copied into the new segment: the pages read need not stay in RSS
                index.trim_maps_of(session)
        return writer

    def _carry(self, entry: Entry, writer: SegmentWriter, carry: list[memoryview]) -> None:
        """Copy the held blocks of a cut segment into the new one, each verified first."""
        for k, view in enumerate(carry):
            i = writer.seg_first + k
            if not self._index.verify(entry, i, view):
                raise StoreError(f"held block {i} of {writer.session!r} is corrupt: write from block 0", reason="corrupt")
            writer.append_held(view, entry.manifest.digests[i])

    def _commit(self, w: SegmentWriter) -> Manifest:
        if w.next_index != w.n_blocks:
            raise StoreError(f"commit with blocks {w.next_index}..{w.n_blocks - 1} of {w.session!r} not written", reason="incomplete")
        index = self._index
        with index.commit_lock:
            entry = index.get(w.session)
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
            index.enforce_budget(keep=w.session)
        return manifest

    def _write_manifest(self, w: SegmentWriter, seq: int) -> Manifest:
        """Rename the segment into place, write tokens, then the manifest (the commit point)."""
        d = w.directory
        sync = self.fsync == "always"
        segments = list(w.keep)
        written: list[Path] = []
        try:
            seg = w.place(f"seg-{seq:08d}.kv", sync)
            if seg is not None:
                written.append(d / seg.file)
                segments.append(seg)
            tokens_file = f"tokens-{seq:08d}.bin"
            write_file(d, tokens_file, bytes_of(w.tokens), sync)
            written.append(d / tokens_file)
            snapshot = _snapshot_of(w, seq, sync)
            if w.snapshot is not None and snapshot is not None and snapshot.file == f"snap-{seq:08d}.bin":
                written.append(d / snapshot.file)
            if sync:
                fsync_dir(d)  # the segment and tokens names are durable before the manifest names them
            digests = list(w.base.digests[: w.seg_first]) if w.base else []
            manifest = Manifest(
                w.session, w.fingerprint, w.block_size, w.block_bytes, w.tokens, w.hashes, digests + w.digests,
                w.generation, _wall_clock(), tuple(segments), seq, tokens_file, snapshot,
            )  # fmt: skip
            write_file(d, MANIFEST, manifest_json(manifest), sync)
            if sync:
                fsync_dir(d)
        except BaseException:
            for p in written:
                unlink_quietly(p)
            raise
        w.mark_committed()
        return manifest

    def _install(self, w: SegmentWriter, manifest: Manifest) -> None:
        """Swap the new manifest into the index; delete the files it no longer names."""
        self._index.install(manifest, w.seg_first)
        if w.base is not None:
            live = {s.file for s in manifest.segments} | {manifest.tokens_file} | _snapshot_files(manifest)
            for f in {s.file for s in w.base.segments} | {w.base.tokens_file} | _snapshot_files(w.base):
                if f not in live:
                    unlink_quietly(w.directory / f)


def _snapshot_files(m: Manifest) -> set[str]:
    return {m.snapshot.file} if m.snapshot is not None else set()


def _snapshot_of(w: SegmentWriter, seq: int, sync: bool) -> StoredSnapshot | None:
    """The snapshot the new version holds: the write's (its file written now), or the held one while the blocks
    before it are kept; the further of the two when both are."""
    held = w.base.snapshot if w.base is not None else None
    if held is not None and held.pos > w.first_block * w.block_size:
        held = None  # the tokens before it may differ now
    if w.snapshot is None or (held is not None and held.pos > w.snapshot[0]):
        return held
    pos, data, digest = w.snapshot
    name = f"snap-{seq:08d}.bin"
    write_file(w.directory, name, data, sync)
    return StoredSnapshot(name, pos, len(data), digest)


def _checked_tokens(
    fingerprint: str, block_size: int, block_bytes: int, tokens: np.ndarray, hashes: list[bytes], first_block: int
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
    toks = readonly(toks[: n * block_size].copy())
    if block_hashes(chain_seed(fingerprint), toks, block_size) != hashes:
        raise StoreError("block hashes do not match the hash chain of the tokens", reason="hash_chain")
    return toks


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
        held = common_prefix(base.hashes, hashes)
        raise StoreError(f"first_block {first_block}, but only {held} leading blocks of {session!r} match", reason="prefix")


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
