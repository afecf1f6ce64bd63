"""The operator's actions on this host: drain, undrain, migrate a session, replicate one now.

An action on a session is carried out by its home host: any other node relays it there
(`relay_action`, peer-authenticated). The same helper carries admin host actions to the
host they name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from kvmesh.node.engine.boundary import EngineAPI
from kvmesh.node.kvshare.service import PushResult
from kvmesh.node.mesh.auth import PEER_HEADER
from kvmesh.node.mesh.mesh import Mesh
from kvmesh.node.protocol import (
    ActionResult,
    DrainCompleted,
    DrainProgress,
    DrainStarted,
    Event,
    MigrateCompleted,
    MigrateStarted,
    Undrained,
    session_path,
)


class RelayFailed(Exception):
    """The host an action was relayed to did not answer, or refused it (an HTTP error status)."""

    def __init__(self, host: str, reason: str, *, status: int | None = None):
        super().__init__(f"{host}: {reason}")
        self.host, self.reason, self.status = host, reason, status


async def relay_action(mesh: Mesh, host: str, path: str, *, timeout_s: float) -> ActionResult:
    """POST an action to a peer (with the mesh secret) and read its ActionResult.

    Raises RelayFailed: `status` set when the peer answered with an error status, None when
    it did not answer (unknown host, transport failure, an answer that is no ActionResult)."""
    peer = mesh.peers.peers.get(host)
    if peer is None:
        raise RelayFailed(host, "not a host of this mesh")
    headers = {PEER_HEADER: mesh.peer_token} if mesh.peer_token else {}
    try:
        resp = await mesh.peers.client.post(f"{peer.cfg.api}{path}", headers=headers, timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - any transport failure reads the same to the operator
        raise RelayFailed(host, type(e).__name__) from None
    if resp.status_code != 200:
        raise RelayFailed(host, f"HTTP {resp.status_code}", status=resp.status_code)
    try:
        return ActionResult.model_validate_json(resp.content)
    except ValueError as e:
        raise RelayFailed(host, type(e).__name__) from None


class Operator:
    """Drain and undrain this host; migrate and replicate the sessions homed here."""

    # A relayed session action may push a whole replica before it answers.
    SESSION_RELAY_TIMEOUT_S = 120.0

    def __init__(self, name: str, engine: EngineAPI, mesh: Mesh, *, push: Callable[[str, str], Awaitable[PushResult]],
                 publish: Callable[[Event], object]):
        """`push(session, target)` sends the session's replica to target (kv_share)."""
        self.name, self.engine, self.mesh = name, engine, mesh
        self._push, self._publish = push, publish
        self._tasks: set[asyncio.Future[Any]] = set()
        self.drain_task: asyncio.Future[None] | None = None  # the last drain's pushes, while they run

    def stop(self) -> None:
        for t in self._tasks:
            t.cancel()

    async def host_action(self, action: str) -> ActionResult:
        if action == "undrain":
            self.mesh.draining = False
            self._publish(Undrained(host=self.name))
            return ActionResult(ok=True, message=f"{self.name} takes new turns again")
        if action != "drain":
            return ActionResult(ok=False, message=f"unknown action {action!r}")
        if self.mesh.draining:
            return ActionResult(ok=True, message=f"{self.name} is already draining")
        self.mesh.draining = True
        sessions = [s for s in list(self.engine.sessions) if self.mesh.home(s) in (self.name, None)]
        self._publish(DrainStarted(host=self.name, sessions=len(sessions)))
        self.drain_task = self._spawn(self._drain(sessions))
        return ActionResult(ok=True, message=f"draining {self.name}: pushing {len(sessions)} sessions to their next hosts")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _drain(self, sessions: list[str]) -> None:
        """Push each resident session to the host it would go to next, so the drain is warm."""
        moved = failed = 0
        for i, s in enumerate(sessions):
            d = self.mesh.predict_next(s)
            ok = False
            if d is not None and d.host != self.name:
                ok = (await self._push(s, d.host)).ok
            moved += ok
            failed += not ok
            self._publish(DrainProgress(host=self.name, done=i + 1, total=len(sessions)))
        self._publish(DrainCompleted(host=self.name, moved=moved, failed=failed))

    async def _relay(self, host: str, path: str) -> ActionResult:
        """A session action carried out on `host` (the session's home, or a migration's target)."""
        try:
            return await relay_action(self.mesh, host, path, timeout_s=self.SESSION_RELAY_TIMEOUT_S)
        except RelayFailed as e:
            if e.status is not None:
                return ActionResult(ok=False, message=f"host {host} refused it: {e.reason}")
            return ActionResult(ok=False, message=f"home host {host} did not answer: {e.reason}")

    async def migrate(self, session: str, target: str, *, relay: bool = True) -> ActionResult:
        """Push the session's replica to target, then make target its home."""
        home = self.mesh.home(session)
        if relay and home is not None and home != self.name:
            return await self._relay(home, f"/v1/peer/sessions/{session_path(session)}/migrate?target={target}")
        seq = self.mesh.next_seq(session)
        if target == self.name:
            self.mesh.book.adopt(session, seq)
            return ActionResult(ok=True, message=f"{session} is already homed on {target}")
        if self.engine.resident_tokens(session) == 0:
            return ActionResult(ok=False, message=f"{self.name} holds no cache of {session}")
        self._publish(MigrateStarted(session=session, src=self.name, dst=target))
        res = await self._push(session, target)
        ok = res.ok
        msg = f"{res.tokens} tokens now on {target}" if ok else f"replica push failed: {res.reason} {res.message}"
        if ok:
            adopt = await self._relay(target, f"/v1/peer/sessions/{session_path(session)}/adopt?seq={seq}")
            ok = adopt.ok
            if not ok:
                msg = adopt.message
        self._publish(MigrateCompleted(session=session, src=self.name, dst=target, ok=ok, message=msg))
        return ActionResult(ok=ok, message=msg)

    async def replicate_now(self, session: str, *, relay: bool = True) -> ActionResult:
        """Push the session's replica to the host placement predicts next, now."""
        home = self.mesh.home(session)
        if relay and home is not None and home != self.name:
            return await self._relay(home, f"/v1/peer/sessions/{session_path(session)}/replicate")
        d = self.mesh.predict_next(session)
        if d is None or d.host == self.name:
            return ActionResult(ok=False, message=f"no other host could take {session} now")
        res = await self._push(session, d.host)
        if res.ok:
            return ActionResult(ok=True, message=f"{session}: {res.tokens} tokens on {d.host} ({res.bytes_sent} bytes sent)")
        return ActionResult(ok=False, message=f"{session}: push to {d.host} failed: {res.reason} {res.message}")
