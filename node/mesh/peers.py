"""Peers: the configured hosts of the mesh and a live view of each one's status.

Each node polls its peers' `GET /v1/peer/status` every `poll_interval_s`; a
peer not heard from within `stale_after_s` is unreachable: shown as such,
never routed to, never hidden.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from pydantic import ValidationError

from kvmesh.node.config import PeerConfig
from kvmesh.node.mesh.auth import PEER_HEADER
from kvmesh.node.mesh.wirecount import CountingTransport, WireCounts
from kvmesh.node.protocol import (
    Event,
    PeerDown,
    PeerStatus,
    PeerUp,
    SessionHolding,
    session_path,
)

log = logging.getLogger("kvmesh.mesh.peers")


@dataclass
class Peer:
    cfg: PeerConfig
    status: PeerStatus | None = None
    heard_at: float = 0.0  # monotonic
    reachable: bool = False
    error: str = ""
    sessions: dict[str, SessionHolding] = field(default_factory=dict)
    pending: int = 0  # turns this node forwarded there and that have not started yet

    @property
    def name(self) -> str:
        return self.cfg.name


class PeerTable:
    def __init__(self, peers: list[PeerConfig], *, token: str | None, poll_interval_s: float, stale_after_s: float,
                 publish: Callable[[Event], object], verify: ssl.SSLContext | bool = True):
        self.peers = {p.name: Peer(p) for p in peers}
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
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._client:
            await self._client.aclose()

    def add(self, cfg: PeerConfig) -> None:
        """A peer joins (DNS discovery): polled from the next round on; an existing name is re-addressed."""
        old = self.peers.get(cfg.name)
        if old is not None and old.cfg == cfg:
            return
        self.peers[cfg.name] = Peer(cfg)
        log.info("peer %s joins at %s", cfg.name, cfg.api)

    def remove(self, name: str) -> None:
        """A peer leaves (DNS discovery): no longer polled, placed on or forwarded to."""
        if self.peers.pop(name, None) is not None:
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
            await asyncio.gather(*(self.poll(p) for p in list(self.peers.values())))
            self._expire()
            await asyncio.sleep(self.poll_interval_s)

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

    def update(self, peer: Peer, status: PeerStatus) -> None:
        peer.status = status
        peer.sessions = {s.session: s for s in status.sessions}
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
