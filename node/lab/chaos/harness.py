"""One scenario's mesh: three `kvmesh node` processes on loopback, a fault proxy on every kv_share link.

`Drill` starts a fresh mesh per scenario (sim engine, 2 slots, kv_scale 0.02, a small
`replicate_min_tokens`, a store dir per node, a mesh secret and an admin token). Each node's peer
`kvshare` address in the TOML written here is a `LinkProxy`, so the drill sees every transfer and
can fault any of them. It drives its own turns (pinned to a host the way a peer would, with the
mesh secret, or placed by the mesh), runs the coding-agent load, and records what it measured:
`fault` (what was injected and what happened), `checks` (what that fault is about), `not_run`
(why the fault could not be injected at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvmesh.node.lab.chaos.cleanup import CLEANUP
from kvmesh.node.lab.chaos.proxy import LinkProxy
from kvmesh.node.lab.chaos.turns import MODEL, Conv, DrillLoad, Pair, TurnResult
from kvmesh.node.lab.launcher import NodeProcess, client_key_headers, free_port, write_toml
from kvmesh.node.lab.load import LoadShape
from kvmesh.node.mesh.auth import PEER_HEADER, peer_token

NAMES = ("node-a", "node-b", "node-c")
BLOCK = 256
KV_SCALE = 0.02  # 400 KV bytes per token: a block is 100 KiB, a 12k-token session ~4.7 MiB
SIM = {"kv_scale": KV_SCALE, "decode_tps": 200.0, "prefill_tps": 20000.0}
CACHE_BYTES = 64 << 20
POLL_S = 0.25
STALE_S = 1.5
# A peer-forwarded turn runs where it is sent, without placement (node.api.openai_routes).
# The drill holds the mesh secret, so it can pin a turn to a host the way a peer would.
FORWARDED_HEADER = "X-Kvmesh-Forwarded"


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
        # The nodes inherit KVMESH_API_KEY: with it set, their cluster view and stats want it, as turns do.
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0), limits=httpx.Limits(max_connections=64),
                                      headers=client_key_headers())
        self.pairs: list[Pair] = []
        self.probe_turns = 0
        self.probe_failures: list[str] = []
        self.probe_5xx = 0
        self.lost_on_faulted_host = 0
        self.fault: dict[str, Any] = {}
        self.checks: dict[str, bool] = {}
        self.notes: list[str] = []
        self.not_run: str | None = None  # why the fault could not be injected: nothing was tested
        self.load: DrillLoad | None = None
        self._load_task: asyncio.Task[Any] | None = None
        self.entries: list[str] = []
        self._undo: Callable[[], None] | None = None

    def cannot_inject(self, reason: str) -> None:
        """The scenario's fault could not be injected here: it reports "not run", never "passed"."""
        self.not_run = reason
        self.fault["hit"] = False

    # ---- lifecycle --------------------------------------------------------------------

    def configure(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Proxies bind first: a port chosen by free_port afterwards cannot be one of theirs.
        for s in NAMES:
            for d in NAMES:
                if s != d:
                    self.proxies[(s, d)] = LinkProxy(s, d)
        ports = {n: (free_port(), free_port()) for n in NAMES}
        for (_src, d), px in self.proxies.items():
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
        threads = [threading.Thread(target=stop_quietly, args=(p,)) for p in self.nodes.values()]
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
        await asyncio.gather(*(asyncio.to_thread(stop_quietly, p) for p in self.nodes.values()))

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
                    res.created = int(obj["created"])
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
                if "created" in obj:
                    res.created = int(obj["created"])
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
            async with asyncio.timeout(180.0):  # not wait_for: see node.mesh.statestream
                await self._load_task

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


def stop_quietly(p: NodeProcess) -> None:
    """Stop one node, killing it if a clean stop fails (cleanup must not raise)."""
    try:
        p.stop(15.0)
    except Exception:  # noqa: BLE001 - make sure it is gone whatever happened
        with contextlib.suppress(Exception):
            p.kill()
