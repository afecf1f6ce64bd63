"""Helpers for the kv_share service tests: real node processes on loopback, a fault-injecting TCP proxy
on the a -> b kv_share path, and a hand-driven kv_share sender (conversations and the /v1/events reader
are tests/support's).

- `start_pair(workdir, ...)`: two `kvmesh node` processes (`a`, `b`, sim engine, blocks of 64 tokens), a
  `node.launcher.LocalMesh` whose link a -> b is routed through the proxy: a's peer entry for b names the
  proxy's address as b's kv_share listener, so every replica a sends to b crosses the proxy; b reaches a
  directly. Both nodes share a mesh secret; b also accepts a previous secret (rotation).
- Turns are pinned to a node with the peer-forwarding headers (`X-Kvmesh-Forwarded` + the mesh secret's
  peer token): the node runs them itself, without placement, so each test says where a turn runs.
- `Proxy`: pass-through by default; one-shot faults (flip one bit in a block's payload, or cut the
  connection inside a block's payload, with a FIN or a RST), a pause gate, a rate limit, and a count of
  concurrent connections.
- `hand_send(...)`: drives `node.kvshare.wire.Sender` over a raw socket with real offers (tokens of a chat
  template, chain hashes seeded with the node's engine fingerprint, sim KV bytes) and optional faults.

Nothing waits a fixed time where it can poll (`wait_for`); every process, socket and thread started here
is stopped by its owner (`Pair.stop`, `Proxy.close`, `EventStream.close`).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from support.conversation import Conversation, Turn
from support.events import EventStream

from kvmesh.node.config import EngineConfig
from kvmesh.node.engine.engine import Engine
from kvmesh.node.engine.hashing import block_hashes, chain_seed
from kvmesh.node.engine.simkv import block_bytes
from kvmesh.node.kvshare import wire
from kvmesh.node.launcher import LocalMesh, free_port, wait_for, wait_peers, write_mesh
from kvmesh.node.mesh.auth import PEER_HEADER, peer_token

BLOCK = 64
MODEL = "kvmesh-sim"
SIM = {"kv_scale": 0.02, "prefill_tps": 1e6, "decode_tps": 1000.0}


def engine_cfg(*, cache_bytes: int = 64 << 20, slots: int = 2) -> dict[str, Any]:
    return {"kind": "sim", "slots": slots, "cache_bytes": cache_bytes, "block_size": BLOCK, "sim": dict(SIM)}


@dataclass(frozen=True)
class EngineFacts:
    """What a node with this engine config computes (sim engines are deterministic)."""

    fingerprint: str
    block_bytes: int


def engine_facts(engine: dict[str, Any]) -> EngineFacts:
    e = Engine(EngineConfig.model_validate({**engine, "cache_bytes": 1}))  # 4 blocks: the pool minimum
    try:
        return EngineFacts(e.fingerprint, e.block_bytes)
    finally:
        e.close()


def whole(tokens: int) -> int:
    """Tokens in the whole blocks of `tokens` tokens."""
    return tokens // BLOCK * BLOCK


# ---- the proxy ------------------------------------------------------------------------------

_PREFIX = struct.Struct("<4sBBIII")
_MAC = 32
_BLOCK_HDR = 37


@dataclass
class Fault:
    """One-shot: applied to the next connection through the proxy.

    kind "flip": flip bit 0 of byte `offset` of the payload of the `block`-th block sent;
    kind "cut": forward up to that byte, then drop both connections ("fin": close; "rst": abort)."""

    kind: str
    block: int
    offset: int
    how: str = "fin"


class Proxy:
    """A TCP proxy thread between a kv_share sender and a listener, with faults on the sender's stream."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.fault: Fault | None = None
        self.applied: list[Fault] = []
        self.rate_bps: float | None = None  # sender -> listener bytes per second (None: as fast as it goes)
        self.connections = 0
        self.active = 0
        self.max_active = 0
        self._gate = threading.Event()
        self._gate.set()
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # inherited: little buffering in the proxy
        ls.bind(("127.0.0.1", 0))
        ls.listen(16)
        self._listener = ls
        self.port = ls.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._spawn(self._accept_loop, "proxy-accept")

    # -- controls

    def reset_counts(self) -> None:
        with self._lock:
            self.connections = 0
            self.max_active = self.active

    def pause(self) -> None:
        """Hold the sender's bytes in the proxy (the connection stays open) until resume()."""
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    # -- plumbing

    def _spawn(self, fn: Callable[..., None], name: str, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.add(s)

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._closed:
                client.close()
                return
            with self._lock:
                fault, self.fault = self.fault, None
                self.connections += 1
                self.active += 1
                self.max_active = max(self.max_active, self.active)
            self._track(client)
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                self._done_one()
                continue
            self._track(upstream)
            conn = _Conn(self, client, upstream, fault)
            self._spawn(conn.forward, "proxy-a2b")
            self._spawn(conn.backward, "proxy-b2a")

    def _done_one(self) -> None:
        with self._lock:
            self.active -= 1

    def close(self) -> None:
        self._closed = True
        self._gate.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            socks, threads = list(self._socks), list(self._threads)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in threads:
            t.join(5)


class _Conn:
    def __init__(self, proxy: Proxy, client: socket.socket, upstream: socket.socket, fault: Fault | None):
        self.p, self.c, self.u, self.fault = proxy, client, upstream, fault
        self._ends = 0
        self._lock = threading.Lock()

    def _end(self) -> None:
        with self._lock:
            self._ends += 1
            last = self._ends == 2
        if last:
            for s in (self.c, self.u):
                s.close()
            self.p._done_one()

    def _drop(self, how: str) -> None:
        """Cut the connection, both sides at once: with FINs ("fin"), or resetting the listener's side ("rst")."""
        if how == "rst":
            with contextlib.suppress(OSError):
                self.u.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.u.shutdown(socket.SHUT_RD)  # wakes the other pump's recv without sending anything
                self.u.close()  # linger 0: the close sends a RST
        for s in (self.u, self.c):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def forward(self) -> None:
        """Sender -> listener, where faults apply."""
        pos = 0
        head = bytearray()
        target: int | None = None
        f = self.fault
        try:
            while True:
                data = self.c.recv(16384)
                if not data:
                    with contextlib.suppress(OSError):
                        self.u.shutdown(socket.SHUT_WR)
                    return
                self.p._gate.wait()
                if f is not None and target is None:
                    head += data
                    if len(head) >= _PREFIX.size:
                        _, _, _, hlen, ntok, nhash = _PREFIX.unpack(head[: _PREFIX.size])
                        if len(head) >= _PREFIX.size + hlen:
                            bb = json.loads(bytes(head[_PREFIX.size : _PREFIX.size + hlen]))["block_bytes"]
                            offer_len = _PREFIX.size + hlen + 4 * ntok + 16 * nhash + _MAC
                            target = offer_len + f.block * (_BLOCK_HDR + bb) + _BLOCK_HDR + f.offset
                buf = bytearray(data)
                if f is not None and target is not None and pos <= target < pos + len(buf):
                    self.p.applied.append(f)
                    if f.kind == "flip":
                        buf[target - pos] ^= 0x01
                        f = None
                    else:
                        self.u.sendall(buf[: target - pos])
                        self._drop(f.how)
                        return
                self.u.sendall(buf)
                pos += len(buf)
                if self.p.rate_bps:
                    time.sleep(len(buf) / self.p.rate_bps)
        except OSError:
            self._drop("fin")
        finally:
            self._end()

    def backward(self) -> None:
        try:
            while True:
                data = self.u.recv(65536)
                if not data:
                    with contextlib.suppress(OSError):
                        self.c.shutdown(socket.SHUT_WR)
                    return
                self.c.sendall(data)
        except OSError:
            self._drop("fin")
        finally:
            self._end()


# ---- the pair ---------------------------------------------------------------------------------------


@dataclass
class Pair(LocalMesh):
    """Nodes a and b, the proxy on a's link to b, their secrets and engine facts."""

    proxy: Proxy
    secret: str
    previous_secret: str
    admin_token: str
    facts: dict[str, EngineFacts]
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=60.0))

    @property
    def kv(self) -> dict[str, str]:
        """Each node's own kv_share listener (direct, not through the proxy)."""
        return {n: str(c["kvshare"]["listen"]) for n, c in self.configs.items()}

    def store_dir(self, name: str) -> Path:
        return Path(self.configs[name]["kvshare"]["store_dir"])

    def peer_headers(self) -> dict[str, str]:
        return {PEER_HEADER: peer_token(self.secret.encode())}

    # -- turns and views

    def turn(self, name: str, conv: Conversation, *, max_tokens: int = 1, prev_host: str | None = None,
             grow: int | None = None) -> Turn:
        """One turn of `conv` run on `name` itself (peer-forwarded: no placement); the reply and a tool
        output of `grow` characters are appended when `grow` is given."""
        headers = {"X-Session-Id": conv.session, "X-Kvmesh-Forwarded": "1", **self.peer_headers()}
        if prev_host:
            headers["X-Kvmesh-Prev-Host"] = prev_host
        r = self.http.post(self.api(name) + "/v1/chat/completions", headers=headers,
                           json={"model": MODEL, "messages": conv.messages, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        t = Turn.answered(r.headers, prompt_tokens=body["usage"]["prompt_tokens"], session=conv.session,
                          reply=body["choices"][0]["message"]["content"] or "")
        assert t.host == name
        if grow is not None:
            conv.grow(t.reply, grow)
        return t

    def stats(self, name: str) -> dict[str, Any]:
        r = self.http.get(self.api(name) + "/v1/stats")
        r.raise_for_status()
        return r.json()

    def holding(self, name: str, session: str) -> dict[str, Any]:
        """What `name` itself reports holding of `session`: engine-resident and stored tokens."""
        r = self.http.get(self.api(name) + "/v1/peer/status", headers=self.peer_headers())
        r.raise_for_status()
        return next((s for s in r.json()["sessions"] if s["session"] == session), {"resident_tokens": 0, "store_tokens": 0})

    def admin(self, name: str, path: str) -> httpx.Response:
        return self.http.post(self.api(name) + path, headers={"Authorization": f"Bearer {self.admin_token}"})

    def refused_in(self, name: str, reason: str) -> int:
        """Refusals of `reason` counted by `name`'s receiver, over every source."""
        return sum(int(s["refused"].get(reason, 0)) for s in self.stats(name)["kvshare"]["in"].values())

    @contextlib.contextmanager
    def events(self, name: str) -> Iterator[EventStream]:
        s = EventStream(self.api(name))
        try:
            yield s
        finally:
            s.close()

    def wait_quiet(self, name: str) -> None:
        """Wait until `name` has no replica push in flight (a push pins the session's blocks)."""
        def quiet() -> bool:
            r = self.http.get(self.api(name) + "/v1/peer/status", headers=self.peer_headers())
            return all(s["inflight_to"] is None for s in r.json()["sessions"])
        wait_for(quiet, f"{name} to finish its replica pushes")

    def temp_files(self, name: str) -> list[Path]:
        """Leftover temporary files (the store writes under names starting with '~')."""
        return [p for p in self.store_dir(name).rglob("*") if p.name.startswith("~")]

    # -- lifecycle

    def restart(self, name: str) -> None:
        p = self.nodes[name]
        p.stop()
        p.start()
        p.wait_ready()
        wait_peers(self.nodes.values())

    def stop(self, timeout: float = 15.0) -> None:
        super().stop(timeout)
        self.proxy.close()
        self.http.close()


def start_pair(workdir: Path, *, engines: dict[str, dict[str, Any]] | None = None,
               kvshare: dict[str, Any] | None = None) -> Pair:
    """Nodes a and b started, a's replicas to b through a new proxy; `engines` per node (default engine_cfg())."""
    names = ["a", "b"]
    ports = {n: (free_port(), free_port()) for n in names}
    proxy = Proxy(("127.0.0.1", ports["b"][1]))
    engines = {n: (engines or {}).get(n, engine_cfg()) for n in names}
    secret = "mesh-" + secrets.token_hex(16)
    previous = "prev-" + secrets.token_hex(16)
    admin_token = "adm-" + secrets.token_hex(12)
    try:
        base = write_mesh(
            workdir, names, ports=ports, routes={("a", "b"): proxy.address},
            overrides={n: {"engine": engines[n]} for n in names},
            extra={"admin_token": admin_token,
                   "kvshare": {"replicate_min_tokens": 0, "fsync": "never", "socket_buffer_bytes": 65536,
                               **(kvshare or {})},
                   "mesh": {"secret": secret, "previous_secret": previous, "poll_interval_s": 0.2,
                            "stale_after_s": 2.0}})
        facts = {n: engine_facts(engines[n]) for n in names}
    except BaseException:
        proxy.close()
        raise
    return Pair(base.workdir, base.nodes, base.configs, proxy, secret, previous, admin_token, facts).start()


# ---- a hand-driven sender ------------------------------------------------------------------------------


@dataclass
class HandOffer:
    """A real offer of a session's whole blocks (tokens of a chat template), and its sim KV payloads."""

    offer: wire.Offer
    tokens: np.ndarray
    hashes: list[bytes]

    def payload(self, i: int) -> bytearray:
        bs = self.offer.block_size
        prev = self.hashes[i - 1] if i else chain_seed(self.offer.fingerprint)
        return bytearray(block_bytes(prev, self.tokens[i * bs : (i + 1) * bs], self.offer.block_bytes // bs, bs))


def hand_offer(facts: EngineFacts, session: str, tokens: np.ndarray, *, sender: str = "hand", generation: int = 1,
               **override: Any) -> HandOffer:
    n = len(tokens) // BLOCK
    toks = np.ascontiguousarray(tokens[: n * BLOCK], dtype=np.int32)
    fields: dict[str, Any] = {"session": session, "sender": sender, "fingerprint": facts.fingerprint, "block_size": BLOCK,
                              "block_bytes": facts.block_bytes, "n_blocks": n, "generation": generation,
                              "sent_at": time.time()}
    fields.update(override)
    hashes = block_hashes(chain_seed(facts.fingerprint), toks, BLOCK)
    return HandOffer(wire.Offer(**fields), toks, hashes)


def _parse_addr(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def read_reply(sock: socket.socket, tx: wire.Sender) -> wire.SenderEvent | str:
    """The receiver's next reply as an event, or 'closed'/'reset' if the connection ended first."""
    try:
        while True:
            data = sock.recv(max(1, tx.want()))
            events = tx.feed(data) if data else tx.eof()
            if not data and not events:
                return "closed"
            if events:
                return events[0]
    except wire.ProtocolError as e:
        return "closed" if e.reason == "truncated" else f"protocol:{e.reason}"
    except ConnectionResetError:
        return "reset"


def hand_send(addr: str, secret: bytes | str, ho: HandOffer, *, corrupt: int | None = None, stop_after: int | None = None,
              half_payload: bool = False) -> wire.SenderEvent | str:
    """One transfer by hand. corrupt=i: block i's payload goes with one bit flipped (its header carries the true
    digest), then the reply is read at once. stop_after=k: after k blocks (plus half a payload if half_payload)
    the socket is closed without END; returns 'cut'."""
    key = secret.encode() if isinstance(secret, str) else secret
    tx = wire.Sender(key)
    with socket.create_connection(_parse_addr(addr), timeout=10) as sock:
        sock.sendall(tx.offer_bytes(ho.offer, ho.tokens, ho.hashes))
        ev = read_reply(sock, tx)
        if not isinstance(ev, wire.Accepted):
            return ev
        for k, i in enumerate(range(ev.first_missing, ho.offer.n_blocks)):
            if stop_after is not None and k == stop_after:
                if half_payload:
                    p = ho.payload(i)
                    sock.sendall(tx.block_header(i, memoryview(p)) + p[: len(p) // 2])
                return "cut"
            p = ho.payload(i)
            hdr = tx.block_header(i, memoryview(p))
            if corrupt == i:
                p[len(p) // 3] ^= 0x10
                sock.sendall(hdr + p)
                return read_reply(sock, tx)
            sock.sendall(hdr + p)
        if stop_after is not None:
            return "cut"
        sock.sendall(tx.end())
        return read_reply(sock, tx)
