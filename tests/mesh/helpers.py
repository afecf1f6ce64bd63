"""Helpers for the mesh integration tests: real `kvmesh node` processes on loopback.

Every mesh here is three sim-engine nodes (`a`, `b`, `c`): a `node.lab.launcher.LocalMesh` (one TOML per
node, free ports, a full mesh of static peers) with an admin token and, by default, a mesh secret.
Clients are the official `openai` package for turns and `httpx` for the admin, cluster, stats and
metrics endpoints; conversations are `support.conversation`'s, events `support.events`'.

Nodes learn of each other's turns by polling (every `poll_interval_s`, 0.2 s here), so a test that
changes entry node first waits until every entry has heard (`Mesh.settle`), and waits for replicas to
land (`Mesh.wait_replica`) instead of sleeping: `wait_for` polls a predicate with a deadline and says
what it was waiting for when it gives up. The fixtures are in conftest.py.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from support.conversation import Conversation, Turn

from kvmesh.node.lab.workload import text
from kvmesh.node.lab.launcher import LocalMesh, wait_for, write_mesh
from kvmesh.node.mesh.auth import PEER_HEADER, peer_token

NAMES = ("a", "b", "c")
MODEL = "kvmesh-sim"
SIM = {"kv_scale": 0.02, "decode_tps": 200.0, "prefill_tps": 20000.0}
POLL_S = 0.2
STALE_S = 1.5
BLOCK = 256  # the engine's block size (default): replicas and reuse come in whole blocks
HOG_TOKENS = 120_000  # a hog turn's prefill: 6 s at the sim's 20k tokens/s


def whole_blocks(tokens: int) -> int:
    return tokens // BLOCK * BLOCK


@dataclass
class Mesh(LocalMesh):
    """Three nodes, with the clients and the views the mesh tests use."""

    admin_token: str
    secret: str | None
    poll_s: float = POLL_S
    stale_s: float = STALE_S
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=60.0))
    _clients: dict[str, openai.OpenAI] = field(default_factory=dict)

    # ---- clients -------------------------------------------------------------------

    def client(self, name: str) -> openai.OpenAI:
        if name not in self._clients:
            self._clients[name] = openai.OpenAI(base_url=self.api(name) + "/v1", api_key="unused", max_retries=0,
                                                timeout=60.0)
        return self._clients[name]

    def others(self, *exclude: str) -> list[str]:
        return [n for n in self.nodes if n not in exclude]

    # ---- turns -------------------------------------------------------------------

    def turn(self, conv: Conversation, entry: str, *, max_tokens: int = 8, grow: bool = True, pin: bool = False) -> Turn:
        """One non-streaming turn of `conv` through `entry`'s OpenAI API; the reply and a tool output are appended.

        pin: the turn runs on `entry` itself, as a turn a peer forwarded there would (placement is skipped)."""
        headers = {"X-Session-Id": conv.session}
        if pin:
            headers |= {"X-Kvmesh-Forwarded": "1", **self.peer_headers()}
        raw = self.client(entry).chat.completions.with_raw_response.create(
            model=MODEL, messages=conv.messages, max_tokens=max_tokens, temperature=0,  # type: ignore[arg-type]
            extra_headers=headers,
        )
        c = raw.parse()
        reply = c.choices[0].message.content or ""
        assert c.usage is not None
        details = c.usage.prompt_tokens_details
        t = Turn.answered(raw.headers, prompt_tokens=c.usage.prompt_tokens, reply=reply, session=conv.session,
                          status=raw.http_response.status_code,
                          cached_usage=(details.cached_tokens or 0) if details else 0)
        conv.turns.append(t)
        if grow:
            conv.grow(reply)
        return t

    def stream_turn(self, conv: Conversation, entry: str, *, max_tokens: int = 8, grow: bool = True) -> tuple[Turn, str | None]:
        """One streaming turn (SSE) of `conv` through `entry`; returns the turn and its finish_reason."""
        raw = self.client(entry).chat.completions.with_raw_response.create(
            model=MODEL, messages=conv.messages, max_tokens=max_tokens, temperature=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True}, extra_headers={"X-Session-Id": conv.session},
        )
        parts: list[str] = []
        finish = usage = None
        for chunk in raw.parse():
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        assert usage is not None, "no usage chunk although stream_options.include_usage was set"
        reply = "".join(parts)
        details = usage.prompt_tokens_details
        t = Turn.answered(raw.headers, prompt_tokens=usage.prompt_tokens, reply=reply, session=conv.session,
                          status=raw.http_response.status_code,
                          cached_usage=(details.cached_tokens or 0) if details else 0)
        conv.turns.append(t)
        if grow:
            conv.grow(reply)
        return t, finish

    @contextmanager
    def hold_slot(self, session: str, host: str, *, prefill_tokens: int = HOG_TOKENS) -> Iterator[str]:
        """Keep one slot of `host` busy with a long streaming turn of another session homed there.

        The hog session gets a short first turn (wherever placement puts a new session) and is migrated
        to `host` if it landed elsewhere; then a turn that appends `prefill_tokens` of tool output runs on
        its home: the sim engine spends prefill_tokens / prefill_tps seconds on it (a long decode would
        not do: the sim samples END about once per 97 tokens). Yields the host it runs on (checked ==
        host) once every node sees the host's slots busy; the stream is closed on exit."""
        rng = random.Random(session)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": text(rng, 700)},
                                      {"role": "user", "content": "read this"}]
        first = self.client(host).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, max_tokens=1, temperature=0, extra_headers={"X-Session-Id": session})  # type: ignore[arg-type]
        landed = first.headers["x-kvmesh-host"]
        if landed != host:
            r = self.admin(host, f"/v1/admin/sessions/{session}/migrate", {"target": host})
            assert r.status_code == 200 and r.json()["ok"], f"could not pin the hog on {host}: {r.text}"
            self.wait_home(session, host)
        msgs += [{"role": "assistant", "content": first.parse().choices[0].message.content or ""},
                 {"role": "tool", "content": text(rng, prefill_tokens)}]
        stream = self.client(host).chat.completions.with_streaming_response.create(
            model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,  # type: ignore[arg-type]
            extra_headers={"X-Session-Id": session})
        with stream as resp:
            served = resp.headers["x-kvmesh-host"]
            assert served == host, f"the hog turn ran on {served}, not on {host}"
            # The turn started: every node must see the host's slots busy before a test relies on it.
            for n in self.names:
                wait_for(lambda n=n: (h := self.host_info(n, host))["busy"] >= h["slots"],
                         f"{n} to see every slot of {host} busy")
            yield served
            assert self.host_info(host, host)["busy"] >= 1, "the hog turn ended before the test was done with it"

    # ---- views -------------------------------------------------------------------

    def cluster(self, entry: str) -> dict[str, Any]:
        r = self.http.get(self.api(entry) + "/v1/cluster")
        r.raise_for_status()
        return r.json()

    def stats(self, entry: str) -> dict[str, Any]:
        r = self.http.get(self.api(entry) + "/v1/stats")
        r.raise_for_status()
        return r.json()

    def host_info(self, entry: str, host: str) -> dict[str, Any]:
        return next(h for h in self.cluster(entry)["hosts"] if h["name"] == host)

    def session_info(self, entry: str, session: str) -> dict[str, Any] | None:
        return next((s for s in self.cluster(entry)["sessions"] if s["session"] == session), None)

    def transfers_in(self, host: str, src: str) -> int:
        return int(self.stats(host)["kvshare"]["in"].get(src, {}).get("transfers", 0))

    def wait_replica(self, session: str, home: str, min_tokens: int, *, entries: list[str] | None = None,
                     timeout: float = 15.0) -> str:
        """Wait until every entry (default: all) sees a replica of `session` of >= min_tokens on a host
        other than `home`; returns that host."""
        hosts = set()
        for e in entries or self.names:
            def ok(e: str = e) -> str | None:
                s = self.session_info(e, session)
                if s and s["home"] == home and s["replica_host"] and s["replica_host"] != home \
                        and s["replica_tokens"] >= min_tokens:
                    return s["replica_host"]
                return None
            hosts.add(wait_for(ok, f"{e} to see a replica of {session} (>= {min_tokens} tokens) off {home}", timeout))
        assert len(hosts) == 1, f"nodes disagree on the replica holder of {session}: {hosts}"
        return hosts.pop()

    def settle(self, conv: Conversation, *, entries: list[str] | None = None) -> None:
        """Wait until every entry has heard of the conversation's last turn (its host is the home and
        every turn is counted). Peers learn of each other's turns by polling, every poll_interval_s."""
        last = conv.turns[-1].host
        for e in entries or self.names:
            wait_for(lambda e=e: (s := self.session_info(e, conv.session)) is not None and s["home"] == last
                     and s["turns"] == len(conv.turns), f"{e} to see turn {len(conv.turns)} of {conv.session} on {last}")

    def wait_home(self, session: str, home: str, *, entries: list[str] | None = None) -> None:
        for e in entries or self.names:
            wait_for(lambda e=e: (self.session_info(e, session) or {}).get("home") == home,
                     f"{e} to see {home} as the home of {session}")

    # ---- admin ---------------------------------------------------------------------

    def admin(self, entry: str, path: str, body: dict[str, Any] | None = None, *, token: str | None = "",
              authorization: str | None = None, timeout: float = 60.0) -> httpx.Response:
        """POST an admin call; token "" means the right one, None means no Authorization header;
        `authorization` sends that header value verbatim instead."""
        tok = self.admin_token if token == "" else token
        headers = {"Authorization": f"Bearer {tok}"} if tok is not None else {}
        if authorization is not None:
            headers = {"Authorization": authorization}
        return self.http.post(self.api(entry) + path, json=body, headers=headers, timeout=timeout)

    def set_draining(self, entry: str, host: str, draining: bool) -> dict[str, Any]:
        r = self.admin(entry, f"/v1/admin/hosts/{host}/{'drain' if draining else 'undrain'}")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["ok"], body
        return body

    def wait_draining(self, host: str, draining: bool) -> None:
        for e in self.names:
            if self.nodes[e].proc is not None and self.nodes[e].proc.poll() is None:
                wait_for(lambda e=e: self.host_info(e, host)["draining"] is draining,
                         f"{e} to see {host} {'draining' if draining else 'undrained'}")

    def peer_headers(self) -> dict[str, str]:
        return {PEER_HEADER: peer_token(self.secret.encode())} if self.secret else {}

    def peer_status(self, host: str) -> dict[str, Any]:
        r = self.http.get(self.api(host) + "/v1/peer/status", headers=self.peer_headers())
        r.raise_for_status()
        return r.json()

    def holding(self, host: str, session: str) -> dict[str, Any]:
        """What `host` itself reports holding of `session` (engine-resident and stored tokens)."""
        return next((s for s in self.peer_status(host)["sessions"] if s["session"] == session),
                    {"resident_tokens": 0, "store_tokens": 0})

    # ---- lifecycle -------------------------------------------------------------------

    def stop(self, timeout: float = 15.0) -> None:
        for c in self._clients.values():  # idle keep-alive connections first: nothing left for a node to wait on
            c.close()
        self.http.close()
        super().stop(timeout)


# A frozen node polls its peers once, when it starts (after every other node is ready), and then not
# for an hour: what it knows of the others' sessions is only what it asks for itself.
FROZEN_MESH = {"poll_interval_s": 3600.0, "stale_after_s": 7200.0, "push_state": False}


def start_mesh(workdir: Path, *, slots: int = 2, cache_bytes: int = 64 << 20, secret: bool = True,
               mesh: dict[str, Any] | None = None, kvshare: dict[str, Any] | None = None,
               sim: dict[str, Any] | None = None, frozen: str | None = None,
               engine: dict[str, Any] | None = None) -> Mesh:
    """The mesh tests' three nodes, started: `mesh`, `kvshare`, `sim` and `engine` settings override the defaults here;
    a `frozen` node starts last and polls its peers only then (FROZEN_MESH)."""
    admin_token = "adm-" + secrets.token_hex(12)
    mesh_secret = "msk-" + secrets.token_hex(16) if secret else None
    mesh_cfg: dict[str, Any] = {"poll_interval_s": POLL_S, "stale_after_s": STALE_S, "cold_move_after_s": 30.0}
    if mesh_secret:
        mesh_cfg["secret"] = mesh_secret
    mesh_cfg.update(mesh or {})
    engine_cfg = {"kind": "sim", "slots": slots, "cache_bytes": cache_bytes, "queue_max": 8, "sim": {**SIM, **(sim or {})},
                  **(engine or {})}
    extra = {"kvshare": {"replicate_min_tokens": 1024, "fsync": "never", **(kvshare or {})},
             "mesh": mesh_cfg, "admin_token": admin_token}
    base = write_mesh(workdir, NAMES, engine=engine_cfg, extra=extra,
                      overrides={frozen: {"mesh": FROZEN_MESH}} if frozen else None)
    m = Mesh(base.workdir, base.nodes, base.configs, admin_token, mesh_secret, poll_s=float(mesh_cfg["poll_interval_s"]),
             stale_s=float(mesh_cfg["stale_after_s"]))
    m.start(last=[frozen] if frozen else ())
    return m
