"""Helpers for the kv_share service tests: real node processes on loopback, the drills' fault proxy
(`kvmesh.node.chaos.proxy.LinkProxy`) on the a -> b kv_share path, a /v1/events reader, and a hand-driven
kv_share sender.

- `start_pair(workdir, ...)`: two `kvmesh node` processes (`a`, `b`, sim engine, blocks of 64 tokens) with
  configs written here (following `node.launcher.mesh_configs`): a's peer entry for b names the proxy's
  address as b's kv_share listener, so every replica a sends to b crosses the proxy; b reaches a directly.
  Both nodes share a mesh secret; b also accepts a previous secret (rotation).
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
import json
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvmesh.node.bench.workload import text
from kvmesh.node.chaos.proxy import LinkProxy
from kvmesh.node.config import EngineConfig
from kvmesh.node.engine.engine import Engine
from kvmesh.node.engine.hashing import block_hashes, chain_seed
from kvmesh.node.engine.runner import fill_from_hash
from kvmesh.node.engine.tokenizer import ByteTokenizer
from kvmesh.node.kvshare import wire
from kvmesh.node.launcher import NodeProcess, free_port, write_toml
from kvmesh.node.mesh.auth import PEER_HEADER, peer_token

BLOCK = 64
MODEL = "kvmesh-sim"
SIM = {"kv_scale": 0.02, "prefill_tps": 1e6, "decode_tps": 1000.0}
WAIT_S = 15.0
TOKENIZER = ByteTokenizer()


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


def wait_for(pred: Callable[[], Any], what: str, timeout: float = WAIT_S, interval: float = 0.03) -> Any:
    """Poll `pred` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            v = pred()
            if v:
                return v
        except (httpx.HTTPError, KeyError, ValueError) as e:
            last = e
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}" + (f" (last error: {last!r})" if last else ""))
        time.sleep(interval)


# ---- conversations ----------------------------------------------------------------------


class Conversation:
    """Messages whose chat template grows at the end only; content is unique to the session."""

    def __init__(self, session: str, chars: int, seed: int | None = None):
        self.session = session
        self.rng = random.Random(seed if seed is not None else session)
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"[{session}] " + text(self.rng, chars)},
            {"role": "user", "content": "go"},
        ]

    def twin(self, session: str) -> Conversation:
        """Another session with the same messages (the same tokens, so the same chain hashes)."""
        c = Conversation(session, 0)
        c.messages = [dict(m) for m in self.messages]
        return c

    def tokens(self) -> np.ndarray:
        return np.asarray(TOKENIZER.apply_chat_template(self.messages), dtype=np.int32)

    def prompt_len(self) -> int:
        return len(TOKENIZER.apply_chat_template(self.messages))

    def grow(self, reply: str, chars: int) -> None:
        self.messages.append({"role": "assistant", "content": reply})
        self.messages.append({"role": "tool", "content": text(self.rng, chars)})

    def grow_to(self, reply: str, prompt_tokens: int) -> None:
        """Append the reply and a tool output sized so the next prompt is exactly `prompt_tokens` tokens."""
        self.grow(reply, 0)
        room = prompt_tokens - self.prompt_len()
        assert room >= 0, f"the conversation is already {self.prompt_len()} tokens"
        self.messages[-1]["content"] = text(self.rng, room)
        assert self.prompt_len() == prompt_tokens


def whole(tokens: int) -> int:
    """Tokens in the whole blocks of `tokens` tokens."""
    return tokens // BLOCK * BLOCK


@dataclass
class Turn:
    host: str
    cached: int
    prompt_tokens: int
    handoff: str
    reply: str


# ---- events -------------------------------------------------------------------------------------


class EventStream:
    """A background reader of one node's /v1/events: live events (not the replay), as dicts, in order."""

    def __init__(self, api: str):
        from websockets.sync.client import connect

        self._stack = contextlib.ExitStack()
        self._ws = self._stack.enter_context(connect(api.replace("http://", "ws://") + "/v1/events", open_timeout=10,
                                                     max_size=None))
        try:
            first = json.loads(self._ws.recv(timeout=10))
            assert first["type"] == "snapshot", first
        except BaseException:
            self._stack.close()
            raise
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from websockets.exceptions import ConnectionClosed

        while True:
            try:
                ev = json.loads(self._ws.recv())
            except (ConnectionClosed, OSError):
                return
            if ev.get("replay"):
                continue
            with self._lock:
                self.events.append(ev)

    def all(self, type_: str | None = None, **match: Any) -> list[dict[str, Any]]:
        with self._lock:
            evs = list(self.events)
        return [e for e in evs if (type_ is None or e["type"] == type_) and all(e.get(k) == v for k, v in match.items())]

    def wait(self, type_: str, what: str = "", timeout: float = WAIT_S, **match: Any) -> dict[str, Any]:
        return wait_for(lambda: next(iter(self.all(type_, **match)), None), what or f"a {type_} event {match}", timeout)

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            self._thread.join(5)


# ---- the pair ---------------------------------------------------------------------------------------


@dataclass
class Pair:
    workdir: Path
    nodes: dict[str, NodeProcess]
    configs: dict[str, dict[str, Any]]
    kv: dict[str, str]  # each node's own kv_share listener (direct)
    proxy: LinkProxy
    secret: str
    previous_secret: str
    admin_token: str
    facts: dict[str, EngineFacts]
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=60.0))

    def api(self, name: str) -> str:
        return self.nodes[name].api

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
        t = Turn(host=r.headers["x-kvmesh-host"], cached=int(r.headers["x-kvmesh-cached-tokens"]),
                 prompt_tokens=body["usage"]["prompt_tokens"], handoff=r.headers["x-kvmesh-handoff"],
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

    def wait_reachable(self) -> None:
        for n in self.nodes:
            def ok(n: str = n) -> bool:
                r = self.http.get(self.api(n) + "/v1/cluster")
                hosts = r.json()["hosts"]
                return len(hosts) == len(self.nodes) and all(h["reachable"] and not h["draining"] for h in hosts)
            wait_for(ok, f"{n} to see every peer reachable")

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
        self.wait_reachable()

    def logs(self) -> str:
        return "\n".join(f"--- {n} ---\n{p.tail(40)}" for n, p in self.nodes.items())

    def stop(self) -> None:
        for p in self.nodes.values():
            try:
                p.stop()
            except Exception:  # noqa: BLE001 - stop the other one whatever happens
                p.kill()
        self.proxy.close()
        self.http.close()


def start_pair(workdir: Path, *, engines: dict[str, dict[str, Any]] | None = None,
               kvshare: dict[str, Any] | None = None) -> Pair:
    workdir.mkdir(parents=True, exist_ok=True)
    secret = "mesh-" + secrets.token_hex(16)
    previous = "prev-" + secrets.token_hex(16)
    admin_token = "adm-" + secrets.token_hex(12)
    names = ["a", "b"]
    ports = {n: (free_port(), free_port()) for n in names}
    proxy = LinkProxy("a", "b", target=("127.0.0.1", ports["b"][1]))
    engines = {n: (engines or {}).get(n, engine_cfg()) for n in names}
    configs: dict[str, dict[str, Any]] = {}
    paths: dict[str, Path] = {}
    for n in names:
        peers = []
        for peer in names:
            if peer == n:
                continue
            kv = proxy.address if (n, peer) == ("a", "b") else f"127.0.0.1:{ports[peer][1]}"
            peers.append({"name": peer, "api": f"http://127.0.0.1:{ports[peer][0]}", "kvshare": kv})
        cfg: dict[str, Any] = {
            "name": n,
            "admin_token": admin_token,
            "api": {"host": "127.0.0.1", "port": ports[n][0]},
            "engine": engines[n],
            "kvshare": {"listen": f"127.0.0.1:{ports[n][1]}", "store_dir": str(workdir / f"store-{n}"),
                        "replicate_min_tokens": 0, "fsync": "never", "socket_buffer_bytes": 65536,
                        **(kvshare or {})},
            "mesh": {"peers": peers, "secret": secret, "previous_secret": previous, "poll_interval_s": 0.2,
                     "stale_after_s": 2.0},
        }
        configs[n] = cfg
        paths[n] = workdir / f"{n}.toml"
        write_toml(paths[n], cfg)
    nodes = {n: NodeProcess(n, paths[n], workdir) for n in names}
    pair = Pair(workdir, nodes, configs, {n: f"127.0.0.1:{ports[n][1]}" for n in names}, proxy, secret, previous,
                admin_token, {n: engine_facts(engines[n]) for n in names})
    try:
        for proc in nodes.values():
            proc.start()
        for proc in nodes.values():
            proc.wait_ready()
        pair.wait_reachable()
    except BaseException:
        print(pair.logs())
        pair.stop()
        raise
    return pair


# ---- a hand-driven sender ------------------------------------------------------------------------------


@dataclass
class HandOffer:
    """A real offer of a session's whole blocks (tokens of a chat template), and its sim KV payloads."""

    offer: wire.Offer
    tokens: np.ndarray
    hashes: list[bytes]

    def payload(self, i: int) -> bytearray:
        buf = bytearray(self.offer.block_bytes)
        fill_from_hash(memoryview(buf), self.hashes[i])
        return buf


def hand_offer(facts: EngineFacts, session: str, tokens: np.ndarray, *, sender: str = "hand", generation: int = 1,
               **override: Any) -> HandOffer:
    n = len(tokens) // BLOCK
    toks = np.ascontiguousarray(tokens[: n * BLOCK], dtype=np.int32)
    fields: dict[str, Any] = dict(session=session, sender=sender, fingerprint=facts.fingerprint, block_size=BLOCK,
                                  block_bytes=facts.block_bytes, n_blocks=n, generation=generation, sent_at=time.time())
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
