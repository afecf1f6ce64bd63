"""`kvmesh chaos`: fault drills on a local three-node sim mesh, with invariants checked after each.

Every scenario starts a fresh mesh of three `kvmesh node` processes on loopback
(sim engine, 2 slots, kv_scale 0.02, small `replicate_min_tokens`, a store dir
per node, a mesh secret and an admin token). Every directed kv_share link goes
through a TCP proxy run here (each node's peer `kvshare` address in the TOML
written here is the proxy), so the drill sees every transfer, can slow one
down to hit it mid-stream, cut it after N bytes or flip one bit of a block.
The coding-agent workload (`node.load`) runs throughout, plus turns the drill
drives itself; one fault is injected while turns are in flight, then healed.

After each scenario the drill checks, and fails the scenario on any breach:

- failed turns: the load generator's error count and non-200 statuses plus
  the drill's own turns. A turn may be slower or cold, never lost. Clients
  use only entry nodes that are up (a load balancer drops a dead entry); a
  turn the mesh placed on a host that then died counts as lost.
- corrupt or partial replicas: once the nodes have stopped, each replica
  store is re-read file by file, independently of `ReplicaStore`: manifest,
  token file against the chained hashes, segment sizes, every block's payload
  digest, and every block's bytes against the sim engine's content (a function
  of the previous block's hash and the block's tokens, `node.engine.simkv`). The
  receiver writes every imported block behind to its store from its engine
  pool, so a bad byte that reached an engine reaches this check too.
- identical output: every turn (messages, max_tokens, temperature, seed) is
  replayed on a reference node that never fails and the replies compared.
  The reference runs the same model (same fingerprint) with faster sim rates;
  the rates set timing only. The sim seeds its logits from a digest of the KV
  bytes each turn attends, read from its pool, so equal replies mean the
  serving host attended the same KV as the reference: a wrong, stale or
  corrupt import would change the reply.
- leaked temp files: no '~' name in any store once kv_share is idle (checked
  live, and again after a clean stop).
- serving afterwards: a turn pinned on each node, and one through each node
  as the entry, succeed after the fault is healed.

Each scenario also measures that its fault really happened (a drill that
never hit its fault must not pass) and checks what that fault is about (a
retried transfer lands whole, a replica survives a restart, ...).

The last stdout line is one JSON object:
`{"scenarios": N, "passed": N, "failed_turns": 0, "corrupt_imports": 0, "details": [...]}`.
Exit status 0 only when every scenario passed.

Every process, proxy and mount started here is cleaned up on exit, on error
and on Ctrl-C; only PIDs started here are signalled.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import atexit
import collections
import contextlib
import copy
import json
import os
import random
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np

from kvmesh.node.bench.workload import system_prompt, text
from kvmesh.node.engine.hashing import TOKEN_DTYPE, block_hashes, chain_seed, payload_digest
from kvmesh.node.engine.simkv import block_bytes as sim_block_bytes
from kvmesh.node.launcher import NodeProcess, free_port, write_toml
from kvmesh.node.load import LoadRunner, LoadShape
from kvmesh.node.mesh.auth import PEER_HEADER, peer_token
from kvmesh.node.protocol import session_key

NAMES = ("node-a", "node-b", "node-c")
MODEL = "kvmesh-sim"
BLOCK = 256
KV_SCALE = 0.02  # 400 KV bytes per token: a block is 100 KiB, a 12k-token session ~4.7 MiB
SIM = {"kv_scale": KV_SCALE, "decode_tps": 200.0, "prefill_tps": 20000.0}
CACHE_BYTES = 64 << 20
POLL_S = 0.25
STALE_S = 1.5
# A peer-forwarded turn runs where it is sent, without placement (node.api.openai_routes).
# The drill holds the mesh secret, so it can pin a turn to a host the way a peer would.
FORWARDED_HEADER = "X-Kvmesh-Forwarded"
THROTTLE_BPS = 1.5e6  # slows a watched transfer to seconds, so a kill lands mid-stream
HOG_TOKENS = 100_000  # a turn whose prefill keeps the sim busy 5 s: a turn surely in flight on a host
TRANSFER_CHARS = 12_000  # a session big enough for a transfer of ~47 blocks
# A kill must land before the sender has written the whole replica into its kernel buffers
# (kvshare.socket_buffer_bytes, 4 MiB, doubled by Linux): what is written is delivered by the
# kernel after the process dies. 30k tokens is a ~12 MiB replica.
KILL_TRANSFER_CHARS = 30_000

# The kv_share v1 frame layout (node/kvshare/wire.py docstring); the proxy only reads it.
_OFFER_PREFIX = struct.Struct("<4sBBIII")  # magic, version, kind, header_len, n_tokens, n_hashes
_ANSWER_FIXED = struct.Struct("<4sBBBIHH")  # magic, version, kind, status, first_missing, reason_len, message_len
_BLOCK_HEADER = 37  # kind u8 | index u32 | chain hash 16 B | payload digest 16 B
_MAC = 32
_HASH = 16


# ---- cleanup: every process, proxy and mount started here goes away ---------------------


class _Cleanup:
    """Undo actions, most recent first; run on scenario end, on error, on Ctrl-C and at exit."""

    def __init__(self) -> None:
        self._actions: list[tuple[str, Callable[[], None]]] = []
        self._lock = threading.Lock()

    def push(self, what: str, fn: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._actions.append((what, fn))
        return fn

    def discard(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._actions = [(w, f) for w, f in self._actions if f is not fn]

    def run(self) -> None:
        while True:
            with self._lock:
                if not self._actions:
                    return
                what, fn = self._actions.pop()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - undo everything else whatever happens
                print(f"chaos: cleanup of {what} failed: {type(e).__name__}: {e}", file=sys.stderr)


CLEANUP = _Cleanup()
atexit.register(CLEANUP.run)


# ---- the kv_share link proxy ----------------------------------------------------------------

_TRACE = os.environ.get("KVMESH_CHAOS_TRACE") == "1"  # proxy connection lifecycles on stderr


def _trace(msg: str) -> None:
    if _TRACE:
        print(f"{time.monotonic():.3f} proxy {msg}", file=sys.stderr, flush=True)


@dataclass
class Fault:
    """A fault for the next transfer of `session` through one proxy (one-shot).

    The point is inside the payload of one block of those the transfer sends:
    block `int(at * sent)` (sent = blocks the receiver asked for), byte `byte`.
    cut: close both sides there (the receiver gets half a replica, then EOF);
    flip: invert bit `bit` of that byte; watch: change nothing, just signal.
    With `rate_bps` the whole matching connection is throttled."""

    kind: Literal["cut", "flip", "watch"]
    session: str
    at: float = 0.5
    byte: int = 1000
    bit: int = 3
    rate_bps: float | None = None
    fired: threading.Event = field(default_factory=threading.Event)
    info: dict[str, Any] = field(default_factory=dict)
    claimed: bool = False


def parse_offer(head: bytes | bytearray) -> tuple[int, dict[str, Any]] | None:
    """(offer frame length, header JSON) once `head` holds the offer's prefix and header;
    None while more bytes are needed. ValueError: not a kv_share offer."""
    if len(head) < _OFFER_PREFIX.size:
        return None
    magic, _version, _kind, header_len, n_tokens, n_hashes = _OFFER_PREFIX.unpack_from(head)
    if magic != b"KVSH":
        raise ValueError("not a kv_share stream")
    if len(head) < _OFFER_PREFIX.size + header_len:
        return None
    header = json.loads(bytes(head[_OFFER_PREFIX.size : _OFFER_PREFIX.size + header_len]))
    return _OFFER_PREFIX.size + header_len + 4 * n_tokens + _HASH * n_hashes + _MAC, header


class _Conn:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.session: str | None = None
        self.n_blocks = 0
        self.block_bytes = 0
        self.first_missing: int | None = None
        self.fault: Fault | None = None
        self.c2s = 0
        self.threads: list[threading.Thread] = []
        self._ended = 0
        self._lock = threading.Lock()

    def cut(self) -> None:
        for s in (self.client, self.server):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class LinkProxy:
    """A thread-per-direction TCP proxy in front of one node's kv_share listener, for one sender."""

    def __init__(self, src: str, dst: str) -> None:
        self.src, self.dst = src, dst
        self.target: tuple[str, int] | None = None
        self._listener = socket.create_server(("127.0.0.1", 0))
        # A small receive window (inherited by accepted sockets): what a sender has not yet got
        # through stays in its own buffers and dies with it, as on a real link; a big proxy
        # buffer would keep feeding a dead sender's bytes to the receiver for seconds.
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._faults: list[Fault] = []
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.connections = 0
        self.sessions: collections.Counter[str] = collections.Counter()
        self.last_active = time.monotonic()
        self._thread = threading.Thread(target=self._accept, name=f"proxy-{src}-{dst}", daemon=True)
        self._thread.start()

    # ---- control -------------------------------------------------------------------

    def arm(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def disarm(self, fault: Fault) -> None:
        with self._lock:
            if fault in self._faults:
                self._faults.remove(fault)

    def active(self) -> list[str | None]:
        with self._lock:
            return [c.session for c in self._conns]

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.cut()
        for c in conns:
            for t in c.threads:
                t.join(2)
        self._thread.join(2)

    # ---- data path -------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                assert self.target is not None
                server = socket.create_connection(self.target, timeout=2.0)
                server.settimeout(None)
            except (OSError, AssertionError):
                client.close()  # the receiver is down: the sender sees its connection closed
                continue
            conn = _Conn(client, server)
            with self._lock:
                self._conns.add(conn)
                self.connections += 1
                self.last_active = time.monotonic()
            conn.threads = [threading.Thread(target=self._c2s, args=(conn,), daemon=True, name=f"proxy-{self.src}>"),
                            threading.Thread(target=self._s2c, args=(conn,), daemon=True, name=f"proxy-{self.dst}<")]
            for t in conn.threads:
                t.start()

    def _claim(self, session: str) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.session == session and not f.claimed and not f.fired.is_set():
                    f.claimed = True
                    return f
        return None

    def _end(self, conn: _Conn, half: socket.socket) -> None:
        with contextlib.suppress(OSError):
            half.shutdown(socket.SHUT_WR)  # pass the FIN on
        with conn._lock:
            conn._ended += 1
            last = conn._ended == 2
        if last:
            conn.client.close()
            conn.server.close()
            f = conn.fault
            if f is not None and not f.fired.is_set():
                f.claimed = False  # the point was not reached (too few blocks): the next transfer gets it
            with self._lock:
                self._conns.discard(conn)
                self.last_active = time.monotonic()

    def _s2c(self, conn: _Conn) -> None:
        head = bytearray()
        try:
            while True:
                data = conn.server.recv(65536)
                if not data:
                    break
                if conn.first_missing is None and len(head) < _ANSWER_FIXED.size:
                    head += data
                    if len(head) >= _ANSWER_FIXED.size and head[:4] == b"KVSH":
                        conn.first_missing = _ANSWER_FIXED.unpack_from(head)[4]
                conn.client.sendall(data)  # parsed before forwarded: blocks follow only after this
        except Exception as e:  # noqa: BLE001 - whatever breaks, both sides must see the link go
            _trace(f"{self.src}->{self.dst} {conn.session} s2c error {e!r}")
            conn.cut()  # the receiver died: the sender must see it at once
        _trace(f"{self.src}->{self.dst} {conn.session} s2c end")
        self._end(conn, conn.client)

    def _c2s(self, conn: _Conn) -> None:
        head = bytearray()
        offer_len: int | None = None
        target: int | None = None
        pos = 0
        try:
            while True:
                data = conn.client.recv(65536)
                if not data:
                    break
                if offer_len is None:
                    head += data
                    try:
                        parsed = parse_offer(head)
                    except ValueError:
                        parsed, offer_len = None, -1  # not kv_share: pass through untouched
                    if parsed is not None:
                        offer_len, hdr = parsed
                        conn.session = str(hdr.get("session"))
                        conn.n_blocks, conn.block_bytes = int(hdr.get("n_blocks", 0)), int(hdr.get("block_bytes", 0))
                        with self._lock:
                            self.sessions[conn.session] += 1
                        conn.fault = self._claim(conn.session)
                f = conn.fault
                if f is not None and target is None and offer_len and offer_len > 0 and conn.first_missing is not None:
                    sent = conn.n_blocks - conn.first_missing
                    if sent > 0:
                        k = min(sent - 1, int(sent * f.at))
                        target = offer_len + k * (_BLOCK_HEADER + conn.block_bytes) + _BLOCK_HEADER + min(f.byte, conn.block_bytes - 1)
                        f.info.update(blocks_sent=sent, block=conn.first_missing + k, sent_index=k,
                                      offset=target, link=f"{self.src}->{self.dst}")
                if f is not None and target is not None and not f.fired.is_set() and pos <= target < pos + len(data):
                    i = target - pos
                    if f.kind == "cut":
                        self._send(conn, f, data[:i])
                        f.info["bytes_delivered"] = pos + i
                        f.fired.set()
                        conn.cut()
                        break
                    if f.kind == "flip":
                        flipped = bytearray(data)
                        flipped[i] ^= 1 << f.bit
                        data = bytes(flipped)
                        f.info["flipped"] = f"bit {f.bit} of stream byte {target}"
                    self._send(conn, f, data)
                    pos += len(data)
                    conn.c2s = pos
                    f.fired.set()
                    continue
                self._send(conn, f, data)
                pos += len(data)
                conn.c2s = pos
        except Exception as e:  # noqa: BLE001 - whatever breaks, both sides must see the link go
            _trace(f"{self.src}->{self.dst} {conn.session} c2s error {e!r} at {conn.c2s}")
            conn.cut()
        _trace(f"{self.src}->{self.dst} {conn.session} c2s end at {conn.c2s}")
        self._end(conn, conn.server)

    @staticmethod
    def _send(conn: _Conn, f: Fault | None, data: bytes | bytearray) -> None:
        step = 16384  # pace in small slices, so a throttled transfer is steady
        for i in range(0, len(data), step):
            piece = data[i : i + step]
            conn.server.sendall(piece)
            rate = f.rate_bps if f is not None else None  # read once: the drill may lift it any time
            if rate:
                time.sleep(len(piece) / rate)


# ---- replica stores, re-read independently -------------------------------------------------


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


def _verify_replica(d: Path, rep: StoreReport, sim_content: bool) -> None:
    names = {f.name for f in d.iterdir()}
    rep.leaked += [f"{d.name}/{n}" for n in sorted(names) if n.startswith("~")]
    if "manifest.json" not in names:
        rep.leaked.append(f"{d.name}/ (no manifest: a first write that never committed)")
        return
    bad = rep.corrupt.append
    try:
        m = json.loads((d / "manifest.json").read_bytes())
        bs, bb, fp = int(m["block_size"]), int(m["block_bytes"]), str(m["fingerprint"])
        hashes = [bytes.fromhex(h) for h in m["hashes"]]
        digests = [bytes.fromhex(x) for x in m["digests"]]
        segments = [(str(s["file"]), int(s["first"]), int(s["count"])) for s in m["segments"]]
        tokens_file = str(m["tokens_file"])
    except (ValueError, KeyError, TypeError) as e:
        bad(f"{d.name}: manifest.json does not parse ({type(e).__name__}: {e})")
        return
    named = {"manifest.json", tokens_file, *(s[0] for s in segments)}
    rep.leaked += [f"{d.name}/{n} (no manifest names it)" for n in sorted(names - named) if not n.startswith("~")]
    if not isinstance(m.get("session"), str) or session_key(m["session"]) != d.name:  # directories go by the id's key
        bad(f"{d.name}: manifest names session {m.get('session')!r}")
    if len(digests) != len(hashes):
        bad(f"{d.name}: {len(hashes)} hashes but {len(digests)} digests")
        return
    tpath = d / tokens_file
    tokens = np.fromfile(tpath, dtype=TOKEN_DTYPE) if tpath.is_file() else np.zeros(0, dtype=TOKEN_DTYPE)
    if len(tokens) != len(hashes) * bs:
        bad(f"{d.name}: {tokens_file} holds {len(tokens)} tokens, not {len(hashes)} blocks of {bs}")
        return
    if block_hashes(chain_seed(fp), tokens, bs) != hashes:
        bad(f"{d.name}: the token ids do not match the chained block hashes")
        return
    end = 0
    for fname, first, count in segments:
        if first != end:
            bad(f"{d.name}: segment {fname} starts at block {first}, not {end}")
            return
        end += count
        spath = d / fname
        size = spath.stat().st_size if spath.is_file() else -1
        if size != count * bb:
            bad(f"{d.name}: segment {fname} is {size} bytes, not {count * bb} (a partial replica)")
            return
        with open(spath, "rb") as f:
            for i in range(first, first + count):
                data = f.read(bb)
                if payload_digest(data) != digests[i]:
                    bad(f"{d.name}: block {i} fails its payload digest")
                elif sim_content and data != sim_block_bytes(hashes[i - 1] if i else chain_seed(fp),
                                                             tokens[i * bs : (i + 1) * bs], bb // bs, bs):
                    bad(f"{d.name}: block {i}'s bytes are not the sim engine's KV for its tokens (corrupt KV)")
                rep.blocks += 1
    if end != len(hashes):
        bad(f"{d.name}: segments hold {end} blocks, the manifest lists {len(hashes)}")
        return
    rep.replicas += 1


def temp_files(root: Path) -> list[str]:
    """Names starting with '~' anywhere under a store (kv_share's temp names)."""
    if not root.is_dir():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("~*"))


# ---- static check: which clock measures durations ---------------------------------------------

# Findings that are not durations or cross-host orderings, or that only display a wall-clock
# age; each with the reason. Any other finding is a violation of "monotonic for every duration".
WALL_CLOCK_ALLOWED: dict[tuple[str, str, str], str] = {
    ("node/kvshare/service.py", "explain_reuse", "time.time() - m.updated"):
        "display: replica age in Handoff events; the manifest's stamp must survive restarts",
    ("node/kvshare/store.py", "_scan", "sorted(found, key=lambda e: e.manifest.updated)"):
        "persisted: LRU order rebuilt at start from stamps that must survive restarts; a jump only reorders evictions",
    ("node/mesh/mesh.py", "_session_info", "now - rep.store_updated"):
        "display: the cluster view's replica age",
}


def _is_call(n: ast.AST, mod: str | None, name: str) -> bool:
    if not isinstance(n, ast.Call):
        return False
    f = n.func
    if mod is None:
        return isinstance(f, ast.Name) and f.id == name
    return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == mod and f.attr == name


class _Clocks:
    """Which names and attributes hold wall-clock values (time.time(), store._wall_clock()) and
    which monotonic ones, found by propagation: assignments, keyword and positional (dataclass
    field order) arguments, tuple returns. An attribute name given both kinds in different
    classes is ambiguous and counts as neither."""

    def __init__(self, trees: dict[Path, ast.Module]) -> None:
        self.wall_attrs: set[str] = set()
        self.mono_attrs: set[str] = set()
        self.returns: dict[str, set[int]] = {}  # function name -> tuple positions holding wall time
        self.fields: dict[str, list[str]] = {}  # class name -> annotated fields in order
        for t in trees.values():
            for c in (n for n in ast.walk(t) if isinstance(n, ast.ClassDef)):
                self.fields[c.name] = [b.target.id for b in c.body
                                       if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)]
        for _ in range(6):
            before = (len(self.wall_attrs), len(self.mono_attrs), sum(len(v) for v in self.returns.values()))
            for t in trees.values():
                self._learn(t)
            if (len(self.wall_attrs), len(self.mono_attrs), sum(len(v) for v in self.returns.values())) == before:
                break

    def _attr(self, name: str, wall: bool) -> bool:
        mine, theirs = (self.wall_attrs, self.mono_attrs) if wall else (self.mono_attrs, self.wall_attrs)
        return name in mine and name not in theirs

    def is_wall(self, n: ast.AST, names: set[str]) -> bool:
        if _is_call(n, "time", "time") or _is_call(n, None, "_wall_clock"):
            return True
        if isinstance(n, ast.Name):
            return n.id in names
        if isinstance(n, ast.Attribute):
            return self._attr(n.attr, True)
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub)):
            left, right = self.is_wall(n.left, names), self.is_wall(n.right, names)
            return left != right if isinstance(n.op, ast.Sub) else (left or right)
        if isinstance(n, ast.IfExp):
            return self.is_wall(n.body, names) or self.is_wall(n.orelse, names)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("max", "min", "round", "float"):
            return any(self.is_wall(a, names) for a in n.args)
        return False

    def is_mono(self, n: ast.AST) -> bool:
        return any(_is_call(s, "time", "monotonic") or _is_call(s, "time", "perf_counter")
                   or (isinstance(s, ast.Attribute) and self._attr(s.attr, False)) for s in ast.walk(n))

    def local_names(self, fn: ast.AST) -> set[str]:
        names: set[str] = set()
        for _ in range(3):
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign):
                    if self.is_wall(n.value, names):
                        names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
                    elif isinstance(n.value, ast.Call) and isinstance(n.targets[0], ast.Tuple):
                        f = n.value.func
                        fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                        for k in self.returns.get(fname, ()):
                            elts = n.targets[0].elts
                            elt = elts[k] if k < len(elts) else None
                            if isinstance(elt, ast.Name):
                                names.add(elt.id)
        return names

    def _mark(self, attr: str, value: ast.AST, names: set[str]) -> None:
        if self.is_wall(value, names):
            self.wall_attrs.add(attr)
        elif self.is_mono(value) and not isinstance(value, ast.Attribute):
            self.mono_attrs.add(attr)

    def _learn(self, tree: ast.Module) -> None:
        for fn in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
            names = self.local_names(fn)
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign):
                    for tgt in n.targets:
                        for t in ast.walk(tgt):
                            if isinstance(t, ast.Attribute):
                                self._mark(t.attr, n.value, names)
                elif isinstance(n, ast.Call):
                    for kw in n.keywords:
                        if kw.arg:
                            self._mark(kw.arg, kw.value, names)
                    order = self.fields.get(n.func.id, []) if isinstance(n.func, ast.Name) else []
                    for k, arg in enumerate(n.args[: len(order)]):
                        self._mark(order[k], arg, names)
                elif isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple) and isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    pos = {k for k, e in enumerate(n.value.elts) if self.is_wall(e, names)}
                    if pos:
                        self.returns.setdefault(fn.name, set()).update(pos)


def wall_clock_findings(pkg: Path) -> list[dict[str, Any]]:
    """Every subtraction, comparison or ordering over wall-clock values in the package.

    Durations must use time.monotonic(); wall-clock stamps from different hosts must not be
    ordered against each other (their clocks differ, and may jump)."""
    base = pkg.parent
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(pkg.rglob("*.py"))
             if p.name not in ("chaos.py", "soak.py")}
    clocks = _Clocks(trees)
    out: list[dict[str, Any]] = []
    for p, tree in trees.items():
        src = p.read_text()
        rel = str(p.relative_to(base))
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            names = clocks.local_names(fn)
            for n in ast.walk(fn):
                kind = None
                if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub):
                    lw, rw = clocks.is_wall(n.left, names), clocks.is_wall(n.right, names)
                    other = n.left if rw and not lw else n.right if lw and not rw else None
                    # wall - monotonic age = a wall timestamp (a conversion), unless time.time() is in it.
                    mixed = other is not None and clocks.is_mono(other) and not any(
                        _is_call(x, "time", "time") for x in ast.walk(n))
                    if (lw or rw) and not mixed:
                        kind = "duration"
                elif isinstance(n, ast.Compare) and len(n.comparators) == 1 \
                        and not isinstance(n.ops[0], (ast.Is, ast.IsNot, ast.In, ast.NotIn)):
                    # A wall stamp against anything but a constant (0 = "never") or a monotonic value.
                    sides = (n.left, n.comparators[0])
                    walls = [clocks.is_wall(x, names) for x in sides]
                    other = sides[1] if walls[0] else sides[0]
                    if any(walls) and (all(walls) or not (isinstance(other, ast.Constant) or clocks.is_mono(other))):
                        kind = "ordering"
                elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("max", "min", "sorted"):
                    if any(kw.arg == "key" and isinstance(kw.value, ast.Lambda) and clocks.is_wall(kw.value.body, set())
                           for kw in n.keywords):
                        kind = "ordering"
                if kind is None or not isinstance(n, ast.expr):  # every kind above is an expression
                    continue
                expr = ast.get_source_segment(src, n) or ""
                why = WALL_CLOCK_ALLOWED.get((rel, fn.name, expr))
                out.append({"file": rel, "line": n.lineno, "function": fn.name, "kind": kind, "expr": expr[:120],
                            "allowed": why is not None, "why": why or "wall clock used for a duration or a cross-host order"})
    return sorted(out, key=lambda f: (f["file"], f["line"]))


def faketime_lib() -> str | None:
    """libfaketime's multithreaded build, if installed (apt-get install faketime)."""
    for pattern in ("/usr/lib/*/faketime/libfaketimeMT.so.1", "/usr/lib/faketime/libfaketimeMT.so.1",
                    "/usr/local/lib/faketime/libfaketimeMT.so.1", "/usr/lib64/faketime/libfaketimeMT.so.1"):
        for hit in sorted(Path("/").glob(pattern.lstrip("/"))):
            return str(hit)
    return None


# ---- turns -------------------------------------------------------------------------------------


@dataclass
class Pair:
    """One answered turn: what was sent and what came back (replayed on the reference)."""

    source: str
    session: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float
    seed: int | None
    reply: str
    prompt_tokens: int | None = None


@dataclass
class TurnResult:
    ok: bool = False
    status: int = 0
    text: str = ""
    host: str = ""
    handoff: str = ""
    cached: int = 0
    prompt_tokens: int = 0
    error: str = ""
    seconds: float = 0.0

    @property
    def reused(self) -> float:
        return self.cached / max(1, self.prompt_tokens)

    def brief(self) -> dict[str, Any]:
        return {"ok": self.ok, "host": self.host, "handoff": self.handoff, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached, "seconds": round(self.seconds, 2), **({"error": self.error} if self.error else {})}


class Conv:
    """A drill conversation: deterministic from its seed, grows by a reply and a tool output per turn."""

    def __init__(self, session: str, seed: int, chars: int) -> None:
        self.session = session
        self.rng = random.Random(seed)
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": system_prompt(self.rng, chars)},
            {"role": "user", "content": "Build the to-do app from the spec. " + text(self.rng, 200)},
        ]

    def grow(self, reply: str, tool_chars: int = 300) -> None:
        self.messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": text(self.rng, tool_chars)}]


class DrillLoad(LoadRunner):
    """The coding-agent workload, recording every answered turn and stoppable at a phase boundary."""

    def __init__(self, entries: list[str], shape: LoadShape, pairs: list[Pair]) -> None:
        super().__init__(entries, shape, model=MODEL)
        self.pairs = pairs

    async def turn(self, client: httpx.AsyncClient, session: str, messages: list[dict[str, str]]) -> str | None:
        sent = copy.deepcopy(messages)
        reply = await super().turn(client, session, messages)
        if reply is not None:
            self.pairs.append(Pair("load", session, sent, self.shape.max_tokens, 0.0, None, reply))
        return reply

    def stop(self) -> None:
        self._stop.set()  # LoadRunner ends at this event; no other way to end it at a chosen moment


# ---- one scenario's mesh -------------------------------------------------------------------------


class Drill:
    """A fresh three-node mesh with a proxy per kv_share link, the drill's own turns, and the load."""

    def __init__(self, workdir: Path, name: str, seed: int, *, overrides: dict[str, dict[str, Any]] | None = None,
                 env: dict[str, dict[str, str]] | None = None) -> None:
        self.workdir = workdir
        self.name = name
        self.seed = seed
        self.overrides = overrides or {}
        self.env = env or {}
        self.admin_token = "adm-" + secrets.token_hex(12)
        self.secret = "msk-" + secrets.token_hex(16)
        self.peer_token = peer_token(self.secret.encode())
        self.nodes: dict[str, NodeProcess] = {}
        self.proxies: dict[tuple[str, str], LinkProxy] = {}
        self.stores = {n: workdir / f"store-{n}" for n in NAMES}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0), limits=httpx.Limits(max_connections=64))
        self.pairs: list[Pair] = []
        self.probe_turns = 0
        self.probe_failures: list[str] = []
        self.probe_5xx = 0
        self.lost_on_faulted_host = 0
        self.fault: dict[str, Any] = {}
        self.checks: dict[str, bool] = {}
        self.notes: list[str] = []
        self.load: DrillLoad | None = None
        self._load_task: asyncio.Task[Any] | None = None
        self.entries: list[str] = []
        self._undo: Callable[[], None] | None = None

    # ---- lifecycle --------------------------------------------------------------------

    def configure(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Proxies bind first: a port chosen by free_port afterwards cannot be one of theirs.
        for s in NAMES:
            for d in NAMES:
                if s != d:
                    self.proxies[(s, d)] = LinkProxy(s, d)
        ports = {n: (free_port(), free_port()) for n in NAMES}
        for (s, d), px in self.proxies.items():
            px.target = ("127.0.0.1", ports[d][1])
        for n in NAMES:
            self.stores[n].mkdir(parents=True, exist_ok=True)
            cfg: dict[str, Any] = {
                "name": n, "admin_token": self.admin_token,
                "api": {"host": "127.0.0.1", "port": ports[n][0]},
                "engine": {"kind": "sim", "slots": 2, "cache_bytes": CACHE_BYTES, "queue_timeout_s": 120.0,
                           "sim": dict(SIM)},
                # fsync "never": the drills crash processes, not machines; the page cache survives.
                "kvshare": {"listen": f"127.0.0.1:{ports[n][1]}", "store_dir": str(self.stores[n]),
                            "replicate_min_tokens": 1024, "fsync": "never", "io_timeout_s": 10.0,
                            "connect_timeout_s": 2.0},
                "mesh": {"secret": self.secret, "poll_interval_s": POLL_S, "stale_after_s": STALE_S,
                         "peers": [{"name": p, "api": f"http://127.0.0.1:{ports[p][0]}",
                                    "kvshare": self.proxies[(n, p)].address} for p in NAMES if p != n]},
            }
            _merge(cfg, self.overrides.get(n, {}))
            path = self.workdir / f"{n}.toml"
            write_toml(path, cfg)
            self.nodes[n] = NodeProcess(n, path, self.workdir, env=self.env.get(n, {}))

    async def start(self) -> None:
        self._undo = CLEANUP.push(f"mesh of {self.name}", self.close)  # before the first proxy exists
        self.configure()
        for p in self.nodes.values():
            p.start()
        for p in self.nodes.values():
            await asyncio.to_thread(p.wait_ready, 90.0)
        await self.wait_reachable()

    def close(self) -> None:
        """Stop every node (continuing a stopped one first) and every proxy; idempotent."""
        for p in self.nodes.values():
            if p.proc is not None and p.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.proc.pid, signal.SIGCONT)
        threads = [threading.Thread(target=_stop_quietly, args=(p,)) for p in self.nodes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for px in self.proxies.values():
            px.close()
        if self._undo is not None:
            CLEANUP.discard(self._undo)
            self._undo = None

    async def stop_nodes(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(_stop_quietly, p) for p in self.nodes.values()))

    def api(self, n: str) -> str:
        return self.nodes[n].api

    def alive(self, n: str) -> bool:
        p = self.nodes[n].proc
        return p is not None and p.poll() is None

    async def kill(self, n: str) -> None:
        await asyncio.to_thread(self.nodes[n].kill)

    async def restart(self, n: str, *, clean: bool = False) -> None:
        if clean:
            await asyncio.to_thread(self.nodes[n].stop, 30.0)
        self.nodes[n].start()
        await asyncio.to_thread(self.nodes[n].wait_ready, 90.0)
        await self.wait_reachable()

    def signal(self, n: str, sig: signal.Signals) -> None:
        p = self.nodes[n].proc
        assert p is not None and p.poll() is None
        os.kill(p.pid, sig)  # our own child's PID only

    async def wait_reachable(self, timeout: float = 30.0) -> None:
        """Until every live node sees every live peer reachable."""
        deadline = time.monotonic() + timeout
        while True:
            live = [n for n in NAMES if self.alive(n)]
            try:
                views = [await self.get(n, "/v1/cluster") for n in live]
                if all(all(h["reachable"] for h in v["hosts"] if h["name"] in live) for v in views):
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the nodes did not all see each other within {timeout:g}s")
            await asyncio.sleep(0.1)

    # ---- HTTP helpers -------------------------------------------------------------------

    async def get(self, n: str, path: str, *, peer: bool = False) -> Any:
        r = await self.http.get(self.api(n) + path, headers={PEER_HEADER: self.peer_token} if peer else {}, timeout=10.0)
        r.raise_for_status()
        return r.json()

    async def holding(self, n: str, session: str) -> int:
        """Tokens of `session` that host n itself reports holding (engine or store)."""
        st = await self.get(n, "/v1/peer/status", peer=True)
        s = next((x for x in st["sessions"] if x["session"] == session), None)
        return max(s["resident_tokens"], s["store_tokens"]) if s else 0

    async def home(self, entry: str, session: str) -> str | None:
        view = await self.get(entry, "/v1/cluster")
        s = next((x for x in view["sessions"] if x["session"] == session), None)
        return s["home"] if s else None

    async def migrate(self, session: str, src: str, dst: str) -> dict[str, Any]:
        try:
            r = await self.http.post(f"{self.api(src)}/v1/admin/sessions/{session}/migrate", json={"target": dst},
                                     headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=60.0)
        except httpx.HTTPError as e:
            return {"ok": False, "message": f"{type(e).__name__} (the admin call itself failed)"}
        if r.status_code != 200:
            return {"ok": False, "message": f"HTTP {r.status_code}: {r.text[:200]}"}
        return dict(r.json())

    async def turn(self, entry: str, conv: Conv, *, pin: bool = False, stream: bool = False, max_tokens: int = 16,
                   temperature: float = 0.0, seed: int | None = None, grow: bool = True,
                   started: asyncio.Future[str] | None = None, tool_chars: int = 300) -> TurnResult:
        """One turn the drill drives itself; pin=True runs it on `entry` as a peer-forwarded turn."""
        body: dict[str, Any] = {"model": MODEL, "messages": conv.messages, "max_tokens": max_tokens,
                                "temperature": temperature, "stream": stream}
        if seed is not None:
            body["seed"] = seed
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"X-Session-Id": conv.session}
        if pin:
            headers |= {FORWARDED_HEADER: "1", PEER_HEADER: self.peer_token}
        sent = copy.deepcopy(conv.messages)
        res = TurnResult()
        t0 = time.monotonic()
        try:
            if stream:
                await self._stream(entry, body, headers, res, started)
            else:
                r = await self.http.post(self.api(entry) + "/v1/chat/completions", json=body, headers=headers)
                res.status = r.status_code
                if r.status_code == 200:
                    obj = r.json()
                    res.text = obj["choices"][0]["message"]["content"] or ""
                    res.prompt_tokens = int(obj["usage"]["prompt_tokens"])
                    self._headers(r.headers, res)
                    res.ok = True
                else:
                    res.error = f"HTTP {r.status_code}: {r.text[:200]}"
        except (httpx.HTTPError, ValueError, KeyError) as e:
            res.error = f"{type(e).__name__}: {e}"
        finally:
            if started is not None and not started.done():
                started.set_result("")
        res.seconds = time.monotonic() - t0
        self.probe_turns += 1
        if res.status >= 500:
            self.probe_5xx += 1
        if res.ok:
            self.pairs.append(Pair("probe", conv.session, sent, max_tokens, temperature, seed, res.text, res.prompt_tokens))
            if grow:
                conv.grow(res.text, tool_chars)
        else:
            self.probe_failures.append(f"{conv.session} via {entry}{' (pinned)' if pin else ''}: {res.error}")
        return res

    @staticmethod
    def _headers(h: httpx.Headers, res: TurnResult) -> None:
        res.host = h.get("x-kvmesh-host", "")
        res.handoff = h.get("x-kvmesh-handoff", "")
        res.cached = int(h.get("x-kvmesh-cached-tokens", "0") or 0)

    async def _stream(self, entry: str, body: dict[str, Any], headers: dict[str, str], res: TurnResult,
                      started: asyncio.Future[str] | None) -> None:
        async with self.http.stream("POST", self.api(entry) + "/v1/chat/completions", json=body, headers=headers) as r:
            res.status = r.status_code
            self._headers(r.headers, res)
            if started is not None and not started.done():
                started.set_result(res.host)
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                return
            parts: list[str] = []
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    res.error = f"in-band error: {obj['error'].get('code')}: {obj['error'].get('message')}"
                    return
                if obj.get("usage"):
                    res.prompt_tokens = int(obj["usage"]["prompt_tokens"])
                for ch in obj.get("choices", []):
                    parts.append(ch.get("delta", {}).get("content") or "")
            res.text = "".join(parts)
            res.ok = True

    # ---- the workload -----------------------------------------------------------------------

    def start_load(self, entries: list[str], *, sessions: int = 6) -> None:
        self.entries = [self.api(n) for n in entries]
        shape = LoadShape(sessions=sessions, target_tokens=14_000, tool_tokens=(200, 1200), max_tokens=24,
                          think_s=(0.2, 0.8), seed=self.seed)
        self.load = DrillLoad(self.entries, shape, self.pairs)
        self._load_task = asyncio.ensure_future(self.load.run(3600.0))

    async def stop_load(self) -> None:
        if self.load is not None and self._load_task is not None:
            self.load.stop()
            await asyncio.wait_for(self._load_task, 180.0)

    # ---- kv_share traffic --------------------------------------------------------------------

    async def quiesce(self, quiet_s: float = 1.0, timeout: float = 30.0, session: str | None = None) -> bool:
        """Until no kv_share transfer (of `session`, or any) has been open for quiet_s: every push
        goes through a proxy, so the proxies see them all."""
        deadline = time.monotonic() + timeout
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            busy = [s for px in self.proxies.values() for s in px.active() if session is None or s == session]
            if busy:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= quiet_s:
                return True
            await asyncio.sleep(0.05)
        return False

    async def target_without(self, conv: Conv, src: str) -> str:
        """After the session's own replication settled: the other host holding least of it."""
        await self.quiesce(0.5, 15.0, session=conv.session)
        held = {n: await self.holding(n, conv.session) for n in NAMES if n != src}
        return min(held, key=lambda n: (held[n], n))

    def store_log_hits(self, n: str, needle: str) -> int:
        try:
            return self.nodes[n].log_file.read_text(errors="replace").count(needle)
        except FileNotFoundError:
            return 0


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def _stop_quietly(p: NodeProcess) -> None:
    try:
        p.stop(15.0)
    except Exception:  # noqa: BLE001 - make sure it is gone whatever happened
        with contextlib.suppress(Exception):
            p.kill()


# ---- scenarios --------------------------------------------------------------------------------------


@dataclass
class Scenario:
    name: str
    about: str
    run: Callable[[Drill], Awaitable[None]]
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    faulted: str | None = None  # the host the fault hits (for the "keeps serving" report)
    setup: Callable[[Drill], Iterator[None]] | None = None  # context around the mesh (mounts)
    env: Callable[[Drill], dict[str, dict[str, str]]] | None = None


async def _wait(ev: threading.Event, timeout: float) -> bool:
    """Wait for a proxy thread's event without a worker thread (Ctrl-C must not wait on one)."""
    deadline = time.monotonic() + timeout
    while not ev.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return ev.is_set()


async def _hog(d: Drill, host: str, entry: str, seed: int) -> tuple[Conv, asyncio.Task[TurnResult], str]:
    """A session homed on `host`, whose next turn (through `entry`) spends HOG_TOKENS / prefill_tps
    seconds in prefill on `host`: a client's turn surely in flight there. Returns when it started."""
    hog = Conv(f"hog-{host}-{seed}", seed, 600)
    await d.turn(host, hog, pin=True, max_tokens=4, tool_chars=HOG_TOKENS)
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(d.turn(entry, hog, stream=True, max_tokens=8, started=started))
    ran_on = await asyncio.wait_for(started, 30.0)
    return hog, task, ran_on


async def _kill_mid_transfer(d: Drill, *, victim_role: Literal["receiver", "sender"]) -> None:
    src = "node-a"
    big = Conv(f"xfer-{d.seed}", d.seed, KILL_TRANSFER_CHARS)
    await d.turn(src, big, pin=True)
    dst = await d.target_without(big, src)
    victim = dst if victim_role == "receiver" else src
    entry = next(n for n in NAMES if n not in (src, dst))
    d.fault.update(sender=src, receiver=dst, killed=victim)
    # A client's turn in flight on the victim when it dies (placed there by the mesh via `entry`).
    hog, hog_task, hog_host = await _hog(d, victim, entry, d.seed + 1)
    d.fault["turn_in_flight_on_victim"] = hog_host == victim
    d.start_load([n for n in NAMES if n != victim])
    await asyncio.sleep(0.5)
    watch = d.proxies[(src, dst)].arm(Fault("watch", big.session, at=0.05, rate_bps=THROTTLE_BPS))
    mig = asyncio.ensure_future(d.migrate(big.session, src, dst))
    hit = await _wait(watch.fired, 20.0)
    mid_transfer, hog_running = hit and not mig.done(), not hog_task.done()  # before the kill changes them
    refused0 = await _refusals(d, dst, src)
    await d.kill(victim)
    killed_at = time.monotonic()
    watch.rate_bps = None  # what the dead sender's kernel still holds now drains at once
    d.fault.update(hit=mid_transfer, transfer=dict(watch.info), hog_running_at_kill=hog_running)
    d.fault["migrate"] = await mig
    hog_res = await hog_task
    d.fault["hog_turn"] = hog_res.brief()
    if not hog_res.ok and hog_host == victim:
        d.lost_on_faulted_host += 1
        # The client retries, as a client would; the conversation goes on elsewhere.
        retry = await d.turn(entry, hog, max_tokens=8)
        d.fault["hog_retry"] = retry.brief()
    if victim_role == "sender":
        # The receiver must drop the torn transfer (and say so) once the stream ends.
        while (got := await _refusals(d, dst, src)) == refused0 and time.monotonic() - killed_at < 15.0:
            await asyncio.sleep(0.1)
        d.fault.update(receiver_refused={k: v - refused0.get(k, 0) for k, v in got.items() if v > refused0.get(k, 0)},
                       receiver_refused_after_s=round(time.monotonic() - killed_at, 2))
        d.checks["receiver_refused_the_torn_transfer"] = got != refused0
    await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - killed_at)))
    await d.restart(victim)
    # Recovery: the replica can still be delivered whole. A migrate needs the session resident on
    # the sender (after a crash its engine is empty; the load may have evicted it too): a turn
    # there first brings it back from the engine or the store, not from a recompute.
    again = await d.turn(src, big, pin=True)
    d.fault["sender_turn_after_restart" if victim_role == "sender" else "sender_turn_after"] = again.brief()
    d.checks["session_restored_on_sender_not_recomputed"] = again.ok and again.reused >= 0.9
    retry_mig = await d.migrate(big.session, src, dst)
    d.fault["migrate_retry"] = retry_mig
    d.checks["replica_delivered_after_restart"] = bool(retry_mig.get("ok"))
    await asyncio.sleep(2.0)


async def _refusals(d: Drill, host: str, src: str) -> dict[str, int]:
    """Transfers from src that host refused, by reason (its kv_share stats)."""
    st = await d.get(host, "/v1/stats")
    return dict(st["kvshare"]["in"].get(src, {}).get("refused", {}))


async def sc_receiver_killed(d: Drill) -> None:
    await _kill_mid_transfer(d, victim_role="receiver")


async def sc_sender_killed(d: Drill) -> None:
    await _kill_mid_transfer(d, victim_role="sender")


async def _proxy_fault(d: Drill, kind: Literal["cut", "flip"]) -> None:
    src = "node-a"
    big = Conv(f"xfer-{d.seed}", d.seed, TRANSFER_CHARS)
    await d.turn(src, big, pin=True)
    dst = await d.target_without(big, src)
    entry = next(n for n in NAMES if n not in (src, dst))
    d.fault.update(sender=src, receiver=dst)
    d.start_load(list(NAMES))
    await asyncio.sleep(1.5)
    before = await d.holding(dst, big.session)
    refused_before = await _refusals(d, dst, src)
    f = d.proxies[(src, dst)].arm(Fault(kind, big.session, at=0.5))
    first = await d.migrate(big.session, src, dst)
    d.fault.update(hit=f.fired.is_set(), injected=dict(f.info), migrate=first, receiver_held_before=before)
    await asyncio.sleep(0.5)
    after = await d.holding(dst, big.session)
    refused = await _refusals(d, dst, src)
    new_refusals = {k: v - refused_before.get(k, 0) for k, v in refused.items() if v > refused_before.get(k, 0)}
    d.fault.update(receiver_held_after=after, receiver_refused=new_refusals)
    d.checks["transfer_refused"] = not first.get("ok") and bool(new_refusals)
    if kind == "flip":
        d.checks["flip_caught_by_digest"] = "digest" in new_refusals
    d.checks["no_partial_import"] = after == before
    retry = await d.migrate(big.session, src, dst)
    full = await d.holding(src, big.session)
    got = await d.holding(dst, big.session)
    d.fault.update(migrate_retry=retry, sender_holds=full, receiver_holds=got)
    d.checks["retry_delivers_whole_replica"] = bool(retry.get("ok")) and got >= full // BLOCK * BLOCK > 0
    await d.quiesce(0.5, 10.0, session=big.session)
    nxt = await d.turn(entry, big)  # through placement: the session's home is now dst
    d.fault["next_turn"] = nxt.brief()
    d.checks["next_turn_warm"] = nxt.ok and nxt.reused >= 0.9
    await asyncio.sleep(1.5)


async def sc_connection_cut(d: Drill) -> None:
    await _proxy_fault(d, "cut")


async def sc_bit_flip(d: Drill) -> None:
    await _proxy_fault(d, "flip")


DISK_VICTIM = "node-b"
DISK_TMPFS_BYTES = 8 << 20
DISK_BUDGET_BYTES = 6 << 20


def _disk_setup(d: Drill) -> Iterator[None]:
    """As root: an 8 MiB tmpfs on the receiver's store dir (real ENOSPC); else a tiny byte budget."""
    mnt = d.stores[DISK_VICTIM]
    mnt.mkdir(parents=True, exist_ok=True)
    mounted = False
    if os.geteuid() == 0 and shutil.which("mount"):
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_TMPFS_BYTES}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        mounted = r.returncode == 0
        if not mounted:
            d.notes.append(f"tmpfs mount refused ({r.stderr.strip()[:120]}); used a store byte budget instead")
    undo = None
    if mounted:
        undo = CLEANUP.push(f"tmpfs on {mnt}", lambda: _umount(mnt))
        d.fault["mode"] = f"tmpfs of {DISK_TMPFS_BYTES >> 20} MiB on {DISK_VICTIM}'s store (ENOSPC)"
    else:
        d.overrides.setdefault(DISK_VICTIM, {}).setdefault("kvshare", {})["store_budget_bytes"] = DISK_BUDGET_BYTES
        d.fault["mode"] = f"store_budget_bytes {DISK_BUDGET_BYTES} on {DISK_VICTIM} (not root: LRU eviction, no ENOSPC)"
    d.fault["tmpfs"] = mounted
    try:
        yield
    finally:
        if undo is not None:
            CLEANUP.discard(undo)
            _umount(mnt)


def _umount(mnt: Path) -> None:
    for args in (["umount", str(mnt)], ["umount", "-l", str(mnt)]):
        if subprocess.run(args, capture_output=True).returncode == 0:
            return
        time.sleep(0.5)


async def sc_disk_full(d: Drill) -> None:
    v = DISK_VICTIM
    d.start_load(list(NAMES))
    await asyncio.sleep(1.5)
    # Two big replicas pushed into the victim on top of the load's own: > 8 MiB in all.
    moved = []
    for k, src in enumerate(("node-a", "node-c")):
        big = Conv(f"fill-{k}-{d.seed}", d.seed + k, TRANSFER_CHARS)
        await d.turn(src, big, pin=True)
        moved.append((big, src, await d.migrate(big.session, src, v)))
    d.fault["migrations"] = [m[2] for m in moved]
    await asyncio.sleep(2.0)
    enospc = d.store_log_hits(v, "No space left on device")
    st = (await d.get(v, "/v1/stats"))["kvshare"]
    d.fault.update(enospc_log_lines=enospc, store_bytes=st["store_bytes"], store_evictions=st["store_evictions"])
    if d.fault["tmpfs"]:
        du = shutil.disk_usage(d.stores[v])
        d.fault["fs_used_pct"] = round(100 * du.used / du.total, 1)
        d.fault["hit"] = enospc > 0
    else:
        d.fault["hit"] = st["store_evictions"] > 0
    # With its store full, the victim still serves the sessions it holds, and new ones.
    for big, _src, _r in moved:
        t = await d.turn(v, big, pin=True)
        d.fault.setdefault("turns_on_full_host", []).append(t.brief())
    fresh = Conv(f"fresh-{d.seed}", d.seed + 7, 3000)
    d.fault["new_session_on_full_host"] = (await d.turn(v, fresh, pin=True)).brief()
    await asyncio.sleep(1.5)


async def sc_peer_unreachable(d: Drill) -> None:
    v = "node-c"
    homed = [Conv(f"homed-{k}-{d.seed}", d.seed + k, 5000) for k in range(2)]
    for c in homed:
        await d.turn(v, c, pin=True)
    await d.quiesce(0.5, 15.0)
    d.start_load(["node-a", "node-b"])
    await asyncio.sleep(1.5)
    stop_s = 6.0
    d.signal(v, signal.SIGSTOP)
    t0 = time.monotonic()
    d.fault["stopped"] = v
    try:
        # At once: the entries still believe the peer is up and may forward into the frozen host.
        early = asyncio.ensure_future(d.turn("node-a", homed[0], stream=True))
        await asyncio.sleep(STALE_S + 2 * POLL_S + 0.5)
        seen = await d.get("node-a", "/v1/cluster")
        d.fault["marked_unreachable"] = not next(h for h in seen["hosts"] if h["name"] == v)["reachable"]
        late = await d.turn("node-b", homed[1], stream=True)  # after stale_after: placed elsewhere
        d.fault["late_turn"] = late.brief()
        d.checks["turn_after_stale_routed_around"] = late.ok and late.host != v and late.seconds < stop_s / 2
        await asyncio.sleep(max(0.0, stop_s - (time.monotonic() - t0)))
    finally:
        d.signal(v, signal.SIGCONT)
    d.fault["stopped_s"] = round(time.monotonic() - t0, 2)
    d.fault["hit"] = bool(d.fault["marked_unreachable"])
    res = await early
    d.fault["early_turn"] = res.brief()
    await d.wait_reachable()
    await asyncio.sleep(2.0)


EVICT_VICTIM = "node-b"
# 163 blocks of 100 KiB (~41.7k tokens): room for two running load turns (<= 55 blocks each)
# plus the 32-block restore, so a restore that finds no room is the engine's fault, not the pool's.
EVICT_CACHE_BYTES = 16 << 20
EVICT_FLOOD_CHARS = 44_000  # a prompt bigger than the whole pool


async def sc_evict_all(d: Drill) -> None:
    v = EVICT_VICTIM
    keep = [Conv(f"resident{k}-{d.seed}", d.seed + k, 8000) for k in range(2)]
    for c in keep:
        await d.turn(v, c, pin=True)
    await d.quiesce(0.5, 15.0)
    d.start_load(list(NAMES))
    await asyncio.sleep(2.0)
    st = await d.get(v, "/v1/peer/status", peer=True)
    before = {s["session"] for s in st["sessions"] if s["resident_tokens"] > 0}
    # One turn whose prompt is bigger than the whole pool: the engine drops every idle cache at
    # once. Its replica then goes to a peer over a slow link (as 1 Gb/s would be), so the push
    # holds the pool's blocks (Engine.export) for seconds, as it would in the field.
    flood = Conv(f"flood-{d.seed}", d.seed + 3, EVICT_FLOOD_CHARS)
    slow = [d.proxies[(v, n)].arm(Fault("watch", flood.session, at=0.9, rate_bps=8 * THROTTLE_BPS))
            for n in NAMES if n != v]
    fl = await d.turn(v, flood, pin=True, max_tokens=4)
    st = await d.get(v, "/v1/peer/status", peer=True)
    after = {s["session"] for s in st["sessions"] if s["resident_tokens"] > 0} - {flood.session}
    d.fault.update(flood_turn=fl.brief(), resident_before=len(before), still_resident=sorted(before & after),
                   evicted=len(before - after))
    # Running turns keep their blocks (at most one per slot); every idle cache must be gone.
    d.fault["hit"] = bool(before) and not any(c.session in after for c in keep) and len(before & after) <= 2
    # Restores from this host's own store: one while the flood's replica is still on the wire ...
    pushing = any(px.active() for px in (d.proxies[(v, n)] for n in NAMES if n != v))
    e0 = (await d.get(v, "/v1/stats"))["engine"]
    during = await d.turn(v, keep[0], pin=True)
    e1 = (await d.get(v, "/v1/stats"))["engine"]
    d.fault["restore_while_pushing"] = {**during.brief(), "push_in_flight": pushing,
                                        "imported_blocks": e1["imported_blocks"] - e0["imported_blocks"]}
    d.checks["restored_from_store_while_a_push_is_in_flight"] = during.ok and during.reused >= 0.9
    # ... and one once kv_share is idle.
    for f in slow:
        f.rate_bps = None
    await d.quiesce(0.3, 20.0, session=flood.session)  # the load keeps other links busy
    later = await d.turn(v, keep[1], pin=True)
    d.fault["restore_when_idle"] = later.brief()
    d.checks["restored_from_store_when_idle"] = later.ok and later.reused >= 0.9
    await asyncio.sleep(2.0)
    c = (await d.get("node-a", "/v1/cluster"))["counters"]
    d.fault["handoffs"] = c
    d.checks["no_stale_state_cold_handoff"] = c["stale_state_cold"] == 0


async def sc_restart_with_replicas(d: Drill) -> None:
    v = "node-c"
    own = Conv(f"own-{d.seed}", d.seed, 8000)
    await d.turn(v, own, pin=True)
    got = Conv(f"got-{d.seed}", d.seed + 1, 8000)
    await d.turn("node-a", got, pin=True)
    await d.quiesce(0.5, 15.0)
    d.fault["received_replica"] = await d.migrate(got.session, "node-a", v)
    await d.quiesce(0.5, 15.0)
    before = {c.session: await d.holding(v, c.session) for c in (own, got)}
    d.start_load(["node-a", "node-b"])
    await asyncio.sleep(2.0)
    t0 = time.monotonic()
    await d.restart(v, clean=True)
    d.fault.update(restarted=v, restart_s=round(time.monotonic() - t0, 2), held_before=before)
    st = await d.get(v, "/v1/peer/status", peer=True)
    after = {s["session"]: s["store_tokens"] for s in st["sessions"] if s["session"] in before}
    d.fault["store_after_restart"] = after
    d.fault["hit"] = all(before.values())
    d.checks["replicas_survive_restart"] = all(after.get(s, 0) >= before[s] // BLOCK * BLOCK > 0 for s in before)
    for c in (own, got):
        t = await d.turn(v, c, pin=True)
        d.fault[f"turn_after_restart:{c.session}"] = t.brief()
        d.checks[f"warm_from_disk:{c.session.split('-')[0]}"] = t.ok and t.reused >= 0.9
    await asyncio.sleep(2.0)


CLOCK_VICTIM = "node-c"


def _clock_env(d: Drill) -> dict[str, dict[str, str]]:
    lib = faketime_lib()
    if lib is None:
        d.notes.append("libfaketime not installed (apt-get install faketime): static check only")
        return {}
    d.workdir.mkdir(parents=True, exist_ok=True)
    d.fault["clock_file"] = str(d.workdir / "faketime.txt")
    (d.workdir / "faketime.txt").write_text("+0\n")
    # The wall clock only: CLOCK_MONOTONIC cannot jump. (This libfaketime build breaks
    # time.sleep in that mode; the node's event loop and threads never call it.)
    return {CLOCK_VICTIM: {"LD_PRELOAD": lib, "FAKETIME_TIMESTAMP_FILE": d.fault["clock_file"], "FAKETIME_NO_CACHE": "1",
                           "FAKETIME_DONT_FAKE_MONOTONIC": "1"}}


async def sc_clock_jump(d: Drill) -> None:
    pkg = Path(__file__).resolve().parent
    findings = wall_clock_findings(pkg)
    bad = [f for f in findings if not f["allowed"]]
    d.fault["static_check"] = {"findings": len(findings), "violations": bad,
                               "allowed": [f"{f['file']}:{f['line']} {f['why']}" for f in findings if f["allowed"]]}
    d.checks["durations_use_monotonic_static"] = not bad
    v = CLOCK_VICTIM
    d.start_load(list(NAMES))
    await asyncio.sleep(1.5)
    if "clock_file" not in d.fault:
        d.fault["hit"] = True  # nothing to inject: the static check is the drill
        await asyncio.sleep(2.0)
        return
    clock = Path(d.fault["clock_file"])
    jumps: list[dict[str, Any]] = []
    for offset, src, dst in (("+3600", v, "node-a"), ("-3600", "node-a", v)):
        clock.write_text(offset + "\n")
        await asyncio.sleep(1.0)
        health = await d.get(v, "/health")
        m = Conv(f"clock-{'fwd' if offset[0] == '+' else 'back'}-{d.seed}", d.seed + len(jumps), 5000)
        await d.turn(src, m, pin=True)
        await d.quiesce(0.5, 15.0, session=m.session)
        mig = await d.migrate(m.session, src, dst)
        await asyncio.sleep(4 * POLL_S)
        homes = {e: await d.home(e, m.session) for e in NAMES}
        nxt = await d.turn("node-b", m)
        reach = await d.get("node-a", "/v1/cluster")
        jumps.append({"jump": f"{offset} s on {v}", "migrate": f"{m.session} {src}->{dst}: {mig.get('ok')}",
                      "home_seen_by": homes, "next_turn": nxt.brief(), "uptime_s_on_jumped_host": health["uptime_s"],
                      "peers_reachable": all(h["reachable"] for h in reach["hosts"])})
        d.checks[f"migrate_moves_home_after_{'forward' if offset[0] == '+' else 'backward'}_jump"] = \
            bool(mig.get("ok")) and all(h == dst for h in homes.values())
        d.checks[f"peers_stay_reachable_{'forward' if offset[0] == '+' else 'backward'}"] = jumps[-1]["peers_reachable"]
    clock.write_text("+0\n")
    d.fault["jumps"] = jumps
    d.fault["hit"] = True
    await asyncio.sleep(2.0)


SCENARIOS: list[Scenario] = [
    Scenario("receiver-killed", "receiver node SIGKILLed mid-transfer (a turn in flight on it), then restarted",
             sc_receiver_killed),
    Scenario("sender-killed", "sender node SIGKILLed mid-transfer (a turn in flight on it), then restarted",
             sc_sender_killed),
    Scenario("connection-cut", "kv_share connection cut half-way through a replica (proxy)", sc_connection_cut),
    Scenario("bit-flip", "one bit of one block's payload flipped in transit (proxy)", sc_bit_flip),
    Scenario("disk-full", "receiver's replica store on a full filesystem (8 MiB tmpfs; byte budget if not root)",
             sc_disk_full, faulted=DISK_VICTIM, setup=_disk_setup),
    Scenario("peer-unreachable", "a host with sessions homed on it SIGSTOPped for 6 s (API answers nothing), then SIGCONT",
             sc_peer_unreachable, faulted="node-c"),
    Scenario("evict-all", "one host's engine drops every idle cache at once (tiny pool, one pool-sized turn)",
             sc_evict_all, overrides={EVICT_VICTIM: {"engine": {"cache_bytes": EVICT_CACHE_BYTES}}}, faulted=EVICT_VICTIM),
    Scenario("restart-with-replicas", "a host restarted (SIGTERM) with its own and received replicas on disk",
             sc_restart_with_replicas, faulted="node-c"),
    Scenario("clock-jump", "wall clock of one host jumps +1 h then -2 h (libfaketime); static check of durations",
             sc_clock_jump, faulted=CLOCK_VICTIM, env=_clock_env),
]


# ---- running a scenario, and the invariants ------------------------------------------------------------


async def _serving_after(d: Drill) -> dict[str, Any]:
    """Every node answers a turn pinned on it and a turn it places as the entry."""
    out: dict[str, Any] = {}
    for k, n in enumerate(NAMES):
        pinned = await d.turn(n, Conv(f"alive-pin-{n}-{d.seed}", d.seed * 31 + k, 1500), pin=True, max_tokens=8)
        entry = await d.turn(n, Conv(f"alive-entry-{n}-{d.seed}", d.seed * 37 + k, 1500), max_tokens=8,
                             temperature=0.8, seed=d.seed + k)
        out[n] = {"pinned": pinned.ok, "as_entry": entry.ok, "entry_served_by": entry.host}
    return out


async def replay(ref_api: str, pairs: list[Pair], http: httpx.AsyncClient) -> tuple[int, list[dict[str, Any]]]:
    """Replay every answered turn on the reference node; returns (compared, mismatches)."""
    sem = asyncio.Semaphore(8)
    mismatches: list[dict[str, Any]] = []

    async def one(p: Pair) -> None:
        body: dict[str, Any] = {"model": MODEL, "messages": p.messages, "max_tokens": p.max_tokens,
                                "temperature": p.temperature, "stream": False}
        if p.seed is not None:
            body["seed"] = p.seed
        async with sem:
            r = await http.post(f"{ref_api}/v1/chat/completions", json=body, headers={"X-Session-Id": p.session},
                                timeout=120.0)
        r.raise_for_status()
        obj = r.json()
        want = obj["choices"][0]["message"]["content"] or ""
        tokens = int(obj["usage"]["prompt_tokens"])
        if want != p.reply or (p.prompt_tokens is not None and tokens != p.prompt_tokens):
            mismatches.append({"source": p.source, "session": p.session, "turn_messages": len(p.messages),
                               "got": p.reply[:60], "reference": want[:60], "prompt_tokens": p.prompt_tokens,
                               "reference_prompt_tokens": tokens})

    await asyncio.gather(*(one(p) for p in pairs))
    return len(pairs), mismatches


def _node_errors(d: Drill) -> dict[str, int]:
    out = {}
    for n, p in d.nodes.items():
        try:
            log = p.log_file.read_text(errors="replace")
        except FileNotFoundError:
            continue
        k = log.count("Traceback")
        if k:
            out[n] = k
    return out


async def run_scenario(sc: Scenario, workdir: Path, seed: int, ref_api: str) -> dict[str, Any]:
    d = Drill(workdir, sc.name, seed, overrides=copy.deepcopy(sc.overrides))
    t0 = time.monotonic()
    failures: list[str] = []
    detail: dict[str, Any] = {"name": sc.name, "about": sc.about}
    stores: list[StoreReport] = []
    compared = 0
    mismatches: list[dict[str, Any]] = []
    live_temp: dict[str, list[str]] = {}
    serving: dict[str, Any] = {}
    ctx = contextlib.contextmanager(sc.setup)(d) if sc.setup else contextlib.nullcontext()
    with ctx:  # a mount (disk-full) outlives the nodes and the store check, nothing more
        try:
            if sc.env is not None:
                d.env = sc.env(d)
            try:
                await d.start()
                await sc.run(d)
                serving = await _serving_after(d)
            except Exception as e:  # noqa: BLE001 - a drill that breaks is a failed scenario, with the reason
                failures.append(f"drill error: {type(e).__name__}: {e}")
            finally:
                if d.load is not None:
                    d.load.stop()  # on Ctrl-C too; the turns in flight end on their own
            try:
                await d.stop_load()
            except Exception as e:  # noqa: BLE001
                failures.append(f"load did not stop: {type(e).__name__}: {e}")
            if d.nodes and all(d.alive(n) for n in NAMES):
                if not await d.quiesce(1.0, 30.0):
                    failures.append("kv_share never went idle")
                live_temp = {n: t for n in NAMES if (t := temp_files(d.stores[n]))}
            await d.stop_nodes()
            stores = [await asyncio.to_thread(verify_store, d.stores[n], n) for n in NAMES]
        finally:
            d.close()  # nodes and proxies gone before the mount is
    try:
        compared, mismatches = await replay(ref_api, d.pairs, d.http)
    except httpx.HTTPError as e:
        failures.append(f"reference replay failed: {type(e).__name__}: {e}")
    await d.http.aclose()

    st = d.load.stats if d.load is not None else None
    load_errors = st.errors if st else 0
    load_non200 = sum(v for k, v in st.status.items() if k != "200") if st else 0
    load_5xx = sum(v for k, v in st.status.items() if k.startswith("5")) if st else 0
    failed_turns = load_errors + len(d.probe_failures)
    corrupt = sum(len(s.corrupt) for s in stores)
    leaked = sum(len(s.leaked) for s in stores) + sum(len(v) for v in live_temp.values())
    serving_ok = bool(serving) and all(v["pinned"] and v["as_entry"] for v in serving.values())
    if failed_turns:
        failures.append(f"{failed_turns} client turns failed ({load_errors} load, {len(d.probe_failures)} drill)")
    if load_5xx + d.probe_5xx:
        failures.append(f"{load_5xx + d.probe_5xx} turns got a 5xx")
    if corrupt:
        failures.append(f"{corrupt} corrupt or partial replicas committed")
    if mismatches:
        failures.append(f"{len(mismatches)} of {compared} replies differ from the reference node's")
    if leaked:
        failures.append(f"{leaked} leaked temp or orphan files in stores")
    if not serving_ok:
        failures.append("a node did not serve turns after the fault")
    if not d.fault.get("hit"):
        failures.append("the fault was not injected as planned (nothing was tested)")
    failures += [f"check failed: {k}" for k, ok in d.checks.items() if not ok]
    detail.update({
        "passed": not failures, "seconds": round(time.monotonic() - t0, 1), "failures": failures,
        "failed_turns": failed_turns, "http_5xx": load_5xx + d.probe_5xx, "corrupt_imports": corrupt,
        "lost_on_faulted_host": d.lost_on_faulted_host,
        "turns": {"load": st.turns if st else 0, "load_errors": load_errors, "load_non_200": load_non200,
                  "load_status": dict(st.status) if st else {}, "load_handoffs": dict(st.handoffs) if st else {},
                  "drill": d.probe_turns, "drill_failed": len(d.probe_failures),
                  "latency_p99_s": st.summary()["latency_p99_s"] if st else None},
        "error_samples": ((st.error_samples[:4] if st else []) + d.probe_failures[:4])[:6],
        "outputs_compared": compared, "output_mismatches": mismatches[:3],
        "replicas_checked": sum(s.replicas for s in stores), "blocks_rehashed": sum(s.blocks for s in stores),
        "corrupt": [c for s in stores for c in s.corrupt][:5],
        "leaked_temp_files": leaked, "leaked": ([f"{s.host}: {x}" for s in stores for x in s.leaked]
                                               + [f"{n} (live): {x}" for n, v in live_temp.items() for x in v])[:6],
        "serving_after": serving_ok, "serving": serving, "checks": d.checks, "fault": d.fault,
        "node_tracebacks": _node_errors(d), "notes": d.notes,
    })
    return detail


def _reference(workdir: Path) -> NodeProcess:
    """A single node that never fails: the same model, faster sim rates (they set timing only)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = {"name": "reference", "api": {"host": "127.0.0.1", "port": free_port()},
           "engine": {"kind": "sim", "slots": 8, "cache_bytes": 256 << 20, "queue_timeout_s": 300.0,
                      "sim": {"kv_scale": KV_SCALE, "decode_tps": 5000.0, "prefill_tps": 2_000_000.0}},
           "kvshare": {"listen": f"127.0.0.1:{free_port()}", "store_dir": str(workdir / "store-reference"),
                       "replicate_min_tokens": 1 << 30, "persist_own": False, "fsync": "never"}}
    path = workdir / "reference.toml"
    write_toml(path, cfg)
    return NodeProcess("reference", path, workdir)


def _line(det: dict[str, Any]) -> str:
    t = det["turns"]
    head = (f"{'PASS' if det['passed'] else 'FAIL'} {det['name']:<22} {det['seconds']:>6.1f}s  "
            f"turns {t['load']}+{t['drill']}, failed {det['failed_turns']}, 5xx {det['http_5xx']}, "
            f"corrupt {det['corrupt_imports']}/{det['blocks_rehashed']} blocks, "
            f"outputs {det['outputs_compared'] - len(det['output_mismatches'])}/{det['outputs_compared']} same, "
            f"leaked {det['leaked_temp_files']}")
    return head + "".join(f"\n      - {f}" for f in det["failures"])


async def _run_all(names: list[str], workdir: Path, seed: int) -> list[dict[str, Any]]:
    ref = _reference(workdir / "reference")
    ref.start()
    undo = CLEANUP.push("reference node", lambda: _stop_quietly(ref))
    try:
        await asyncio.to_thread(ref.wait_ready, 90.0)
        details = []
        for k, name in enumerate(names):
            sc = next(s for s in SCENARIOS if s.name == name)
            print(f"chaos: {sc.name}: {sc.about} ...", flush=True)
            det = await run_scenario(sc, workdir / sc.name, seed * 1000 + k * 17 + 1, ref.api)
            print(_line(det), flush=True)
            details.append(det)
        return details
    finally:
        CLEANUP.discard(undo)
        _stop_quietly(ref)


def run_chaos(args: argparse.Namespace) -> int:
    if getattr(args, "list", False):
        for s in SCENARIOS:
            print(f"{s.name:<24} {s.about}")
        return 0
    names = [s.name for s in SCENARIOS]
    only = list(getattr(args, "only", None) or [])
    unknown = [n for n in only if n not in names]
    if unknown:
        print(f"kvmesh chaos: unknown scenario(s) {', '.join(unknown)}; known: {', '.join(names)}", file=sys.stderr)
        return 2
    chosen = [n for n in names if not only or n in only]
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-chaos-"))
    keep = bool(getattr(args, "keep", False))
    if not keep:
        CLEANUP.push("work directory", lambda: shutil.rmtree(workdir, ignore_errors=True))
    else:
        print(f"chaos: work directory {workdir} (kept)", flush=True)

    async def main() -> list[dict[str, Any]]:
        # SIGTERM ends the run like Ctrl-C does: cancel, then every finally block cleans up.
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await _run_all(chosen, workdir, int(getattr(args, "seed", 1)))

    try:
        details = asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("kvmesh chaos: interrupted; everything started was stopped", file=sys.stderr)
        return 130
    finally:
        CLEANUP.run()
    result = {"scenarios": len(details), "passed": sum(d["passed"] for d in details),
              "failed_turns": sum(d["failed_turns"] for d in details),
              "corrupt_imports": sum(d["corrupt_imports"] for d in details), "details": details}
    if not getattr(args, "json", False):
        print(f"chaos: {result['passed']} of {result['scenarios']} scenarios passed; "
              f"{result['failed_turns']} failed turns; {result['corrupt_imports']} corrupt imports")
    print(json.dumps(result, default=str), flush=True)
    return 0 if details and result["passed"] == result["scenarios"] else 1
