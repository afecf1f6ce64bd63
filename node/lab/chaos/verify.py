"""The drills' store verifier: each replica store re-read file by file, independently of `ReplicaStore`.

After a scenario the nodes stop and every store is checked: manifest, token file against the
chained hashes, segment sizes, every block's payload digest, and (sim engines) every block's bytes
against the sim's content (a function of the previous block's hash and the block's tokens,
`node.engine.simkv`). A replica a
manifest names and that fails any check is corrupt: a node would import it. Temp names ('~'),
uncommitted directories and files no manifest names are leaks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.node.engine.hashing import (
    TOKEN_DTYPE,
    block_hashes,
    chain_seed,
    payload_digest,
)
from kvmesh.node.engine.simkv import block_bytes as sim_block_bytes
from kvmesh.node.protocol import session_key


@dataclass
class StoreReport:
    host: str
    replicas: int = 0
    blocks: int = 0
    corrupt: list[str] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)


def verify_store(root: Path, host: str, *, sim_content: bool = True) -> StoreReport:
    """Re-read one replica store without `ReplicaStore` (whose scan would delete what we look for).

    corrupt: a committed replica (a manifest names it) that fails any check, i.e. one a node
    would import; leaked: temp files, uncommitted directories, files no manifest names."""
    rep = StoreReport(host)
    if not root.is_dir():
        return rep
    for p in sorted(root.iterdir()):
        if p.name.startswith("~"):
            rep.leaked.append(p.name)
        elif not p.is_dir():
            rep.leaked.append(f"{p.name} (a stray file)")
        else:
            _verify_replica(p, rep, sim_content)
    return rep


@dataclass
class _Manifest:
    """The fields of one replica's manifest.json the verifier checks."""

    session: Any
    block_size: int
    block_bytes: int
    fingerprint: str
    hashes: list[bytes]
    digests: list[bytes]
    segments: list[tuple[str, int, int]]  # file, first block, block count
    tokens_file: str

    @classmethod
    def read(cls, path: Path) -> _Manifest:
        """ValueError, KeyError or TypeError: it does not parse."""
        m = json.loads(path.read_bytes())
        return cls(m.get("session"), int(m["block_size"]), int(m["block_bytes"]), str(m["fingerprint"]),
                   [bytes.fromhex(h) for h in m["hashes"]], [bytes.fromhex(x) for x in m["digests"]],
                   [(str(s["file"]), int(s["first"]), int(s["count"])) for s in m["segments"]], str(m["tokens_file"]))


def _verify_replica(d: Path, rep: StoreReport, sim_content: bool) -> None:
    names = {f.name for f in d.iterdir()}
    rep.leaked += [f"{d.name}/{n}" for n in sorted(names) if n.startswith("~")]
    if "manifest.json" not in names:
        rep.leaked.append(f"{d.name}/ (no manifest: a first write that never committed)")
        return
    try:
        m = _Manifest.read(d / "manifest.json")
    except (ValueError, KeyError, TypeError) as e:
        rep.corrupt.append(f"{d.name}: manifest.json does not parse ({type(e).__name__}: {e})")
        return
    named = {"manifest.json", m.tokens_file, *(s[0] for s in m.segments)}
    rep.leaked += [f"{d.name}/{n} (no manifest names it)" for n in sorted(names - named) if not n.startswith("~")]
    if session_key(m.session) != d.name:  # directories go by the id's key
        rep.corrupt.append(f"{d.name}: manifest names session {m.session!r}")
    tpath = d / m.tokens_file
    tokens = np.fromfile(tpath, dtype=TOKEN_DTYPE) if tpath.is_file() else np.zeros(0, dtype=TOKEN_DTYPE)
    problem = _tokens_problem(m, tokens) or _segments_problem(d, m, tokens, rep, sim_content)
    if problem:
        rep.corrupt.append(f"{d.name}: {problem}")
    else:
        rep.replicas += 1


def _tokens_problem(m: _Manifest, tokens: np.ndarray) -> str | None:
    """What is wrong with the digests list or the token file against the chained hashes, if anything."""
    if len(m.digests) != len(m.hashes):
        return f"{len(m.hashes)} hashes but {len(m.digests)} digests"
    if len(tokens) != len(m.hashes) * m.block_size:
        return f"{m.tokens_file} holds {len(tokens)} tokens, not {len(m.hashes)} blocks of {m.block_size}"
    if block_hashes(chain_seed(m.fingerprint), tokens, m.block_size) != m.hashes:
        return "the token ids do not match the chained block hashes"
    return None


def _segments_problem(d: Path, m: _Manifest, tokens: np.ndarray, rep: StoreReport, sim_content: bool) -> str | None:
    """What is wrong with the segments' layout or sizes, if anything; each block's bad bytes are
    reported in `rep.corrupt` one by one (every block is re-read)."""
    end, bb, bs = 0, m.block_bytes, m.block_size
    for fname, first, count in m.segments:
        if first != end:
            return f"segment {fname} starts at block {first}, not {end}"
        end += count
        spath = d / fname
        size = spath.stat().st_size if spath.is_file() else -1
        if size != count * bb:
            return f"segment {fname} is {size} bytes, not {count * bb} (a partial replica)"
        with open(spath, "rb") as f:
            for i in range(first, first + count):
                data = f.read(bb)
                if payload_digest(data) != m.digests[i]:
                    rep.corrupt.append(f"{d.name}: block {i} fails its payload digest")
                elif sim_content and data != sim_block_bytes(m.hashes[i - 1] if i else chain_seed(m.fingerprint),
                                                             tokens[i * bs : (i + 1) * bs], bb // bs, bs):
                    rep.corrupt.append(f"{d.name}: block {i}'s bytes are not the sim engine's KV for its tokens (corrupt KV)")
                rep.blocks += 1
    if end != len(m.hashes):
        return f"segments hold {end} blocks, the manifest lists {len(m.hashes)}"
    return None


def temp_files(root: Path) -> list[str]:
    """Names starting with '~' anywhere under a store (kv_share's temp names)."""
    if not root.is_dir():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("~*"))

