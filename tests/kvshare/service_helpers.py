"""Helpers for the kv_share service tests: real node processes on loopback, the drills' fault proxy
(`kvmesh.node.lab.chaos.proxy.LinkProxy`) on the a -> b kv_share path, and a hand-driven kv_share sender
(conversations and the /v1/events reader are tests/support's).

- `start_pair(workdir, ...)`: two `kvmesh node` processes (`a`, `b`, sim engine, blocks of 64 tokens), a
  `node.lab.launcher.LocalMesh` whose link a -> b is routed through the proxy: a's peer entry for b names the
  proxy's address as b's kv_share listener, so every replica a sends to b crosses the proxy; b reaches a
  directly. Both nodes share a mesh secret; b also accepts a previous secret (rotation).
- Turns are pinned to a node with the peer-forwarding headers (`X-Kvmesh-Forwarded` + the mesh secret's
  peer token): the node runs them itself, without placement, so each test says where a turn runs.
- `Pair.proxy` (a `LinkProxy`): pass-through by default; armed one-shot faults (flip one bit in a block's
  payload, or cut the connection inside a block's payload, with a FIN or a RST), a pause gate, a rate
  limit, and counts of connections.
- `hand_send(...)`: drives `node.kvshare.wire.Sender` over a raw socket with real offers (tokens of a chat
  template, chain hashes seeded with the node's engine fingerprint, sim KV bytes) and optional faults.

Nothing waits a fixed time where it can poll (`wait_for`); every process, socket and thread started here
is stopped by its owner (`Pair.stop`, `LinkProxy.close`, `EventStream.close`).
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from support.conversation import Conversation, Turn
from support.events import EventStream

from kvmesh.node.lab.chaos.proxy import LinkProxy
from kvmesh.node.config import EngineConfig
from kvmesh.node.engine.engine import Engine
from kvmesh.node.engine.hashing import block_hashes, chain_seed
from kvmesh.node.engine.simkv import block_bytes
from kvmesh.node.kvshare import wire
from kvmesh.node.lab.launcher import LocalMesh, free_port, wait_for, wait_peers, write_mesh
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




# ---- the pair ---------------------------------------------------------------------------------------


@dataclass
class Pair(LocalMesh):
    """Nodes a and b, the proxy on a's link to b, their secrets and engine facts."""

    proxy: LinkProxy
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
        """Wait until `name` has no replica push in flight or queued (a push pins the session's blocks)."""
        def quiet() -> bool:
            r = self.http.get(self.api(name) + "/v1/peer/status", headers=self.peer_headers())
            return (all(s["inflight_to"] is None for s in r.json()["sessions"])
                    and self.stats(name)["kvshare"]["pushes_pending"] == 0)
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
    proxy = LinkProxy("a", "b", target=("127.0.0.1", ports["b"][1]))
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
