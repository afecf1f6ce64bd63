"""A replica's manifest: what the store holds of one session, its manifest.json, and the
checks a session directory must pass at start before any of it is trusted.

manifest.json is the commit point of a replica: it names the session and every other file
of its directory (the tokens file, the segments, the state snapshot), so a file it does not
name is not part of the replica. See `store` for the directory layout.

Format 2 added the snapshot (window cells or recurrent state: node.engine.snapshots); a
manifest of another format is not read (the session is dropped, its next turn recomputes).
"""

from __future__ import annotations

import json
import logging
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvmesh.node.engine.hashing import TOKEN_DTYPE, block_hashes, chain_seed
from kvmesh.node.kvshare.store.files import TEMP_PREFIX, unlink_quietly
from kvmesh.node.protocol import is_valid_session_id, session_key

# One logger for every part of the store, so what operators filter on did not change with the split.
log = logging.getLogger("kvmesh.kvshare.store")

MANIFEST = "manifest.json"
FORMAT: Literal[2] = 2  # 2: a replica may hold a state snapshot beside its blocks


@dataclass(frozen=True)
class StoredSnapshot:
    """The replica's state snapshot: its file, the position it stands at, its size and payload digest."""

    file: str
    pos: int
    nbytes: int
    digest: bytes


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
    snapshot: StoredSnapshot | None = None

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


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items (block hashes, block ids) `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def readonly(tokens: np.ndarray) -> np.ndarray:
    tokens.flags.writeable = False
    return tokens


def disk_bytes(d: Path, m: Manifest) -> int:
    """Bytes on disk of the replica `m` in directory `d` (segments, tokens, manifest)."""
    held = m.nbytes + m.num_tokens * TOKEN_DTYPE.itemsize + (m.snapshot.nbytes if m.snapshot else 0)
    try:
        return held + (d / MANIFEST).stat().st_size
    except OSError:
        return held


# ---- manifest.json ----------------------------------------------------------------

_Hex16 = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class _SegmentModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    file: str = Field(pattern=r"^seg-[0-9]{1,20}\.kv$")
    first: int = Field(ge=0)
    count: int = Field(ge=1)


class _SnapshotModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    file: str = Field(pattern=r"^snap-[0-9]{1,20}\.bin$")
    pos: int = Field(ge=1)
    nbytes: int = Field(ge=1)
    digest: _Hex16


class _ManifestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: Literal[2]
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
    snapshot: _SnapshotModel | None = None


def manifest_json(m: Manifest) -> bytes:
    w = m.snapshot
    model = _ManifestModel(
        format=FORMAT,
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
        snapshot=_SnapshotModel(file=w.file, pos=w.pos, nbytes=w.nbytes, digest=w.digest.hex()) if w else None,
    )
    return model.model_dump_json().encode()


def _format_of(raw: bytes) -> object:
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc.get("format") if isinstance(doc, dict) else None


def manifest_session(d: Path) -> str | None:
    """The session the directory's manifest.json names; None when it cannot be read or parsed."""
    try:
        return _ManifestModel.model_validate_json((d / MANIFEST).read_bytes()).session
    except (OSError, ValidationError):
        return None


# ---- a session directory at start -------------------------------------------------


class Corrupt(Exception):
    """A session directory that cannot be trusted; the message says why."""


def load_dir(d: Path) -> tuple[Manifest, int]:
    """The replica in session directory `d` and its bytes on disk, once every check passed;
    temp leftovers and files its manifest does not name are deleted. Raises Corrupt."""
    for p in d.iterdir():
        if p.name.startswith(TEMP_PREFIX):
            log.info("removing leftover %s", p)
            unlink_quietly(p)
    try:
        raw = (d / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise Corrupt("no manifest.json (a first write that never committed)") from None
    try:
        model = _ManifestModel.model_validate_json(raw)
    except ValidationError as e:
        if (fmt := _format_of(raw)) is not None and fmt != FORMAT:
            raise Corrupt(f"manifest.json is format {fmt}; this node reads format {FORMAT} (the session recomputes)") from None
        first = e.errors()[0]
        raise Corrupt(f"manifest.json does not parse ({'.'.join(map(str, first['loc']))}: {first['msg']})") from None
    m = _from_model(d, model)
    _check_files(d, m)
    live = {s.file for s in m.segments} | {m.tokens_file, MANIFEST} | ({m.snapshot.file} if m.snapshot else set())
    for p in d.iterdir():
        if p.name not in live:
            log.info("removing %s: no manifest names it", p)
            unlink_quietly(p)
    return m, disk_bytes(d, m)


def _from_model(d: Path, model: _ManifestModel) -> Manifest:
    if not is_valid_session_id(model.session) or session_key(model.session) != d.name:
        raise Corrupt(f"manifest.json names session {model.session!r}, whose key is not {d.name}")
    n = len(model.hashes)
    if len(model.digests) != n:
        raise Corrupt(f"{n} hashes but {len(model.digests)} digests")
    end = 0
    for s in model.segments:
        if s.first != end:
            raise Corrupt(f"segment {s.file} starts at block {s.first}, not {end}")
        end += s.count
    if end != n:
        raise Corrupt(f"segments hold {end} blocks, the manifest lists {n}")
    path = d / model.tokens_file
    want = n * model.block_size * TOKEN_DTYPE.itemsize
    if not path.is_file() or path.stat().st_size != want:
        raise Corrupt(f"{model.tokens_file} is missing or not {want} bytes")
    tokens = readonly(np.fromfile(path, dtype=TOKEN_DTYPE))
    hashes = [bytes.fromhex(h) for h in model.hashes]
    if block_hashes(chain_seed(model.fingerprint), tokens, model.block_size) != hashes:
        raise Corrupt("the token ids do not match the block hashes")
    w = model.snapshot
    if w is not None and (w.pos > n * model.block_size or w.pos % model.block_size):
        raise Corrupt(f"the snapshot at {w.pos} is not at a block boundary of the {n} blocks held")
    return Manifest(
        model.session, model.fingerprint, model.block_size, model.block_bytes, tokens, hashes,
        [bytes.fromhex(x) for x in model.digests], model.generation, model.updated,
        tuple(Segment(s.file, s.first, s.count) for s in model.segments), model.seq, model.tokens_file,
        StoredSnapshot(w.file, w.pos, w.nbytes, bytes.fromhex(w.digest)) if w else None,
    )  # fmt: skip


def _check_files(d: Path, m: Manifest) -> None:
    for s in m.segments:
        path = d / s.file
        want = s.count * m.block_bytes
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise Corrupt(f"segment {s.file} is missing") from None
        if size != want:
            raise Corrupt(f"segment {s.file} is {size} bytes, not {want}")
    w = m.snapshot
    if w is not None and (not (d / w.file).is_file() or (d / w.file).stat().st_size != w.nbytes):
        raise Corrupt(f"snapshot {w.file} is missing or not {w.nbytes} bytes")
