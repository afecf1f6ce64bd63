"""Peers: the configured hosts of the mesh and a live view of each one's status.

Each node subscribes to every peer's pushed state (`/v1/peer/state`, node.mesh.statestream) and
polls `GET /v1/peer/status` every `poll_interval_s` only the peers that are not streaming (not yet,
or unable to). A peer not heard from within `stale_after_s` is unreachable: shown as such, never
routed to, never hidden.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import websockets
from pydantic import ValidationError

from kvmesh.node.config import PeerConfig
from kvmesh.node.mesh.auth import PEER_HEADER
from kvmesh.node.mesh.statefeed import StateMirror
from kvmesh.node.mesh.statestream import StreamRefused, subscribe
from kvmesh.node.mesh.wirecount import PEER_STATUS, CountingTransport, WireCounts
from kvmesh.node.protocol import (
    DirectoryEntry,
    Event,
    PeerDown,
    PeerStatus,
    PeerUp,
    SessionHolding,
    session_path,
)

log = logging.getLogger("kvmesh.mesh.peers")
STOP_WAIT_S = 5.0  # how long stop() waits for its cancelled tasks


@dataclass
class Peer:
    cfg: PeerConfig
    status: PeerStatus | None = None
    heard_at: float = 0.0  # monotonic
    reachable: bool = False
    error: str = ""
    sessions: dict[str, SessionHolding] = field(default_factory=dict)
    pending: int = 0  # turns this node forwarded there and that have not started yet
    pending_tokens: int = 0  # ...and their prompts, which its prefill engine will take on (entries herd otherwise)
    streaming: bool = False  # its state arrives pushed (else it is polled)

    @property
    def name(self) -> str:
        return self.cfg.name


class PeerTable:
    def __init__(self, peers: list[PeerConfig], *, token: str | None, poll_interval_s: float, stale_after_s: float,
                 publish: Callable[[Event], object], verify: ssl.SSLContext | bool = True, subscriber: str | None = None,
                 on_sessions: Callable[[str, list[SessionHolding]], None] | None = None):
        """`subscriber`: this node's name, to subscribe to peers' pushed state under (None: poll only);
        `on_sessions` is told what a peer reported of the sessions that changed (a poll: all of them)."""
        self._on_sessions = on_sessions
        self.peers = {p.name: Peer(p) for p in peers}
        self._subscriber = subscriber
        self._streams: dict[str, tuple[Peer, asyncio.Task[None]]] = {}
        self._retry_at: dict[str, float] = {}
        self.version = 0  # bumped whenever a peer joins, leaves or moves
        self.poll_interval_s = poll_interval_s
        self.stale_after_s = stale_after_s
        self._publish = publish
        self._headers = {PEER_HEADER: token} if token else {}
        self._client: httpx.AsyncClient | None = None
        self._verify = verify
        self._task: asyncio.Task[None] | None = None
        self.wire = WireCounts()  # bytes of every exchange with a peer, by kind (wirecount)

    async def start(self) -> None:
        transport = CountingTransport(httpx.AsyncHTTPTransport(verify=self._verify), self.wire)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=1.0), headers=self._headers, transport=transport)
        self._task = asyncio.create_task(self._run(), name="peer-poll")

    async def stop(self) -> None:
        tasks = [t for _, t in self._streams.values()] + ([self._task] if self._task else [])
        for t in tasks:
            t.cancel()
        # Bounded: a node's stop must not wait for good on a task that did not take its cancel.
        pending = (await asyncio.wait(tasks, timeout=STOP_WAIT_S))[1] if tasks else set()
        for t in pending:
            log.warning("peer task %s did not end within %.0fs of its cancel; stopping without it", t.get_name(),
                        STOP_WAIT_S)
        if self._client:
            await self._client.aclose()

    def add(self, cfg: PeerConfig) -> None:
        """A peer joins (DNS discovery): polled from the next round on; an existing name is re-addressed."""
        old = self.peers.get(cfg.name)
        if old is not None and old.cfg == cfg:
            return
        self.peers[cfg.name] = Peer(cfg)
        self.version += 1
        log.info("peer %s joins at %s", cfg.name, cfg.api)

    def remove(self, name: str) -> None:
        """A peer leaves (DNS discovery): no longer polled, placed on or forwarded to."""
        if self.peers.pop(name, None) is not None:
            self.version += 1
            log.warning("peer %s left the mesh", name)
            self._publish(PeerDown(peer=name, reason="left the mesh (no longer in DNS)"))

    def wire_by_peer(self) -> dict[str, dict[str, dict[str, int]]]:
        """Peer HTTP bytes this node opened, by peer name, direction and kind."""
        return self.wire.by_peer({httpx.URL(p.cfg.api).netloc.decode("ascii"): name for name, p in self.peers.items()})

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "PeerTable not started"
        return self._client

    async def _run(self) -> None:
        while True:
            if self._subscriber is not None:
                self._keep_streams()
            await asyncio.gather(*(self.poll(p) for p in list(self.peers.values()) if not p.streaming))
            self._expire()
            await asyncio.sleep(self.poll_interval_s)

    def _keep_streams(self) -> None:
        """One stream task per current peer: a departed or re-addressed peer's ends, a broken one restarts."""
        now = time.monotonic()
        for name, (peer, task) in list(self._streams.items()):
            if self.peers.get(name) is not peer or task.done():
                task.cancel()
                del self._streams[name]
        for name, peer in self.peers.items():
            if name not in self._streams and now >= self._retry_at.get(name, 0.0):
                self._streams[name] = (peer, asyncio.create_task(self._stream(peer), name=f"peer-state-{name}"))

    async def _stream(self, peer: Peer) -> None:
        api = httpx.URL(peer.cfg.api)
        netloc = api.netloc.decode("ascii")
        url = str(api.copy_with(scheme="wss" if api.scheme == "https" else "ws", path="/v1/peer/state",
                                params={"subscriber": self._subscriber or ""}))

        def streamed(status: PeerStatus, mirror: StateMirror) -> None:
            peer.streaming = True
            self.update(peer, status, [mirror.sessions[s] for s in mirror.changed if s in mirror.sessions])

        try:
            await subscribe(url, self._headers, self._verify, silent_after_s=self.stale_after_s, on_status=streamed,
                            count=lambda direction, n: self.wire.add(netloc, direction, PEER_STATUS, n))
        except StreamRefused as e:
            # An older node or a proxy without websockets: polled, and asked again now and then.
            log.info("peer %s does not stream its state (%s); polling it", peer.name, e)
            self._retry_at[peer.name] = time.monotonic() + 30.0
        except (OSError, TimeoutError, websockets.ConnectionClosed, websockets.InvalidHandshake) as e:
            peer.error = type(e).__name__
        finally:
            peer.streaming = False

    async def poll(self, peer: Peer) -> None:
        try:
            r = await self.client.get(f"{peer.cfg.api}/v1/peer/status")
            r.raise_for_status()
            status = PeerStatus.model_validate_json(r.content)
        except (httpx.HTTPError, ValidationError) as e:
            peer.error = type(e).__name__ + (f" {e.response.status_code}" if isinstance(e, httpx.HTTPStatusError) else "")
            return
        self.update(peer, status)

    async def poll_session(self, peer: Peer, session: str) -> None:
        try:
            r = await self.client.get(f"{peer.cfg.api}/v1/peer/sessions/{session_path(session)}", timeout=0.5)
            r.raise_for_status()
            peer.sessions[session] = SessionHolding.model_validate_json(r.content)
        except (httpx.HTTPError, ValidationError):
            pass  # the periodic poll will tell

    async def lookup(self, peer: Peer, session: str) -> bool:
        """Ask a session's directory host what every host holds of it (node.mesh.directory)."""
        try:
            r = await self.client.get(f"{peer.cfg.api}/v1/peer/directory/{session_path(session)}", timeout=0.5)
            r.raise_for_status()
            entry = DirectoryEntry.model_validate_json(r.content)
        except (httpx.HTTPError, ValidationError):
            return False
        for host, held in entry.held.items():
            if host in self.peers:
                self.peers[host].sessions[session] = held
        return True

    def update(self, peer: Peer, status: PeerStatus, changed: list[SessionHolding] | None = None) -> None:
        peer.status = status
        peer.sessions = {s.session: s for s in status.sessions}
        if self._on_sessions is not None:
            self._on_sessions(peer.name, status.sessions if changed is None else changed)
        peer.heard_at = time.monotonic()
        peer.error = ""
        if not peer.reachable:
            peer.reachable = True
            log.info("peer %s is up", peer.name)
            self._publish(PeerUp(peer=peer.name))

    def _expire(self) -> None:
        now = time.monotonic()
        for p in list(self.peers.values()):
            if p.reachable and now - p.heard_at > self.stale_after_s:
                self.mark_down(p.name, p.error or f"not heard from for {self.stale_after_s:g}s")

    def mark_down(self, name: str, reason: str) -> None:
        p = self.peers.get(name)
        if p is not None and p.reachable:
            p.reachable = False
            log.warning("peer %s is unreachable: %s", name, reason)
            self._publish(PeerDown(peer=name, reason=reason))
