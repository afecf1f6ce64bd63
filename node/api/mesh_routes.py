"""Mesh routes: the cluster view, the event stream, peer status, admin actions, metrics.

Peer routes need the mesh secret (`X-Kvmesh-Peer-Auth`); admin routes need the
admin token (`Authorization: Bearer ...`). Neither secret is ever logged or echoed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Body, Header, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response

from kvmesh.node.errors import Conflict, InvalidRequest, NotFound, Unauthorized
from kvmesh.node.mesh.auth import PEER_HEADER, check_bearer, check_peer_token
from kvmesh.node.metrics import render_metrics
from kvmesh.node.node import Node
from kvmesh.node.protocol import (
    ActionResult,
    MigrateCommand,
    SnapshotEvent,
    session_id_problem,
)

log = logging.getLogger("kvmesh.api.mesh")


def check_path_session(session: str) -> None:
    """A session id from a URL path (`{session:path}`: '/' in an id is fine, encoded or not): 400 naming it if refused."""
    problem = session_id_problem(session)
    if problem is not None:
        raise InvalidRequest(f"session: the session id {problem}", param="session")


def router(node: Node) -> APIRouter:
    r = APIRouter()
    admin_token = node.cfg.admin_token.get_secret_value() if node.cfg.admin_token else None

    def require_admin(authorization: str | None) -> None:
        if admin_token is None:
            raise Unauthorized("admin actions are disabled: this node has no admin_token configured")
        if not check_bearer(authorization, admin_token):
            raise Unauthorized("missing or wrong admin token (Authorization: Bearer ...)")

    def require_peer(request: Request) -> None:
        if not check_peer_token(request.headers.get(PEER_HEADER), node.mesh.secrets):
            raise Unauthorized("peer calls need the mesh secret")

    def peer_api(host: str) -> str:
        if host == node.name:
            return ""
        p = node.mesh.peers.peers.get(host)
        if p is None:
            raise NotFound(f"no host {host!r} in this mesh; hosts: {', '.join([node.name, *node.mesh.peers.peers])}")
        return p.cfg.api

    async def on_host(host: str, action: str, request: Request) -> ActionResult:
        """Run a host action here, or relay it (peer-authenticated) to the host it names."""
        api = peer_api(host)
        if not api:
            return await node.host_action(action)
        headers = {PEER_HEADER: node.mesh.peer_token} if node.mesh.peer_token else {}
        try:
            resp = await node.mesh.peers.client.post(f"{api}/v1/peer/{action}", headers=headers, timeout=10.0)
        except Exception as e:  # noqa: BLE001 - any transport failure means the same to the operator
            raise Conflict(f"host {host} did not answer: {type(e).__name__}") from None
        if resp.status_code != 200:
            raise Conflict(f"host {host} refused {action}: HTTP {resp.status_code}")
        return ActionResult.model_validate_json(resp.content)

    # ---- read-only views ---------------------------------------------------

    @r.get("/v1/cluster")
    async def cluster() -> Response:
        return Response(node.mesh.cluster().model_dump_json(), media_type="application/json")

    @r.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return node.stats()

    @r.get("/metrics")
    async def metrics() -> Response:
        body, ctype = render_metrics(node)
        return Response(body, media_type=ctype)

    @r.websocket("/v1/events")
    async def events(ws: WebSocket) -> None:
        await ws.accept()
        sub, replay = node.hub.subscribe()
        try:
            snap = node.hub.stamp(SnapshotEvent(cluster=node.mesh.cluster()))
            await ws.send_text(snap.model_dump_json())
            for old in replay:
                await ws.send_text(old.model_dump_json())
            while True:
                live = await sub.get()
                if live is None:
                    await ws.close(code=1013, reason="consumer too slow; reconnect for a fresh snapshot")
                    return
                await ws.send_text(live.model_dump_json())
        except (WebSocketDisconnect, RuntimeError, asyncio.CancelledError):
            return
        finally:
            sub.close()

    # ---- peer calls (mesh secret) ------------------------------------------

    @r.get("/v1/peer/status")
    async def peer_status(request: Request) -> Response:
        require_peer(request)
        return Response(node.mesh.local_status().model_dump_json(), media_type="application/json")

    @r.get("/v1/peer/sessions/{session:path}")
    async def peer_session(session: str, request: Request) -> Response:
        require_peer(request)
        check_path_session(session)
        return Response(node.mesh.local_holding(session).model_dump_json(), media_type="application/json")

    @r.post("/v1/peer/drain")
    async def peer_drain(request: Request) -> ActionResult:
        require_peer(request)
        return await node.host_action("drain")

    @r.post("/v1/peer/undrain")
    async def peer_undrain(request: Request) -> ActionResult:
        require_peer(request)
        return await node.host_action("undrain")

    @r.post("/v1/peer/sessions/{session:path}/adopt")
    async def peer_adopt(session: str, request: Request, seq: int = 0) -> ActionResult:
        require_peer(request)
        check_path_session(session)
        node.mesh.book.adopt(session, seq or node.mesh.next_seq(session))
        return ActionResult(ok=True, message=f"{node.name} is now home of {session}")

    @r.post("/v1/peer/sessions/{session:path}/migrate")
    async def peer_migrate(session: str, target: str, request: Request) -> ActionResult:
        require_peer(request)
        check_path_session(session)
        return await node.migrate(session, target, relay=False)

    @r.post("/v1/peer/sessions/{session:path}/replicate")
    async def peer_replicate(session: str, request: Request) -> ActionResult:
        require_peer(request)
        check_path_session(session)
        return await node.replicate_now(session, relay=False)

    # ---- admin (admin token) -----------------------------------------------

    @r.post("/v1/admin/hosts/{host}/drain")
    async def drain(host: str, request: Request, authorization: str | None = Header(None)) -> ActionResult:
        require_admin(authorization)
        return await on_host(host, "drain", request)

    @r.post("/v1/admin/hosts/{host}/undrain")
    async def undrain(host: str, request: Request, authorization: str | None = Header(None)) -> ActionResult:
        require_admin(authorization)
        return await on_host(host, "undrain", request)

    @r.post("/v1/admin/sessions/{session:path}/migrate")
    async def migrate(session: str, cmd: MigrateCommand | None = Body(None), target: str | None = None,
                      authorization: str | None = Header(None)) -> ActionResult:
        require_admin(authorization)
        dst = (cmd.target if cmd else None) or target
        if not dst:
            raise Conflict('migrate needs a target host: JSON body {"target": "<host>"}')
        peer_api(dst)  # 404 for an unknown host
        check_path_session(session)
        return await node.migrate(session, dst)

    @r.post("/v1/admin/sessions/{session:path}/replicate")
    async def replicate(session: str, authorization: str | None = Header(None)) -> ActionResult:
        require_admin(authorization)
        check_path_session(session)
        return await node.replicate_now(session)

    return r
