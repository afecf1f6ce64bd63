"""Mesh routes: the cluster view, the event stream, peer status, admin actions, metrics.

Peer routes need the mesh secret (`X-Kvmesh-Peer-Auth`); admin routes need the
admin token (`Authorization: Bearer ...`). Neither secret is ever logged or echoed.
The actions themselves are node.mesh.actions' (`Node.operator`); these routes check
who is asking, parse, and answer.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import (
    APIRouter,
    Body,
    Depends,
    Header,
    Request,
    WebSocket,
    WebSocketDisconnect,
)
from fastapi.responses import Response
from pydantic import BaseModel, Field

from kvmesh.node.api.deps import NodeDep
from kvmesh.node.errors import Conflict, InvalidRequest, NotFound, Unauthorized
from kvmesh.node.mesh.actions import RelayFailed, relay_action
from kvmesh.node.mesh.auth import PEER_HEADER, check_bearer, check_peer_token
from kvmesh.node.mesh.clusterview import mesh_wide, scoped
from kvmesh.node.mesh.discovery import hello
from kvmesh.node.mesh.statefeed import StateFeed
from kvmesh.node.mesh.statestream import push
from kvmesh.node.node import Node
from kvmesh.node.protocol import (
    ActionResult,
    ClusterView,
    ClusterViewEvent,
    MigrateCommand,
    PeerHello,
    session_id_problem,
)

# A host action answers at once (a drain runs on after it), so a relay of one waits briefly.
HOST_RELAY_TIMEOUT_S = 10.0

router = APIRouter()


def _json(body: str) -> Response:
    return Response(body, media_type="application/json")


def _valid_session(session: str) -> str:
    """A session id from a URL path (`{session:path}`: '/' in an id is fine, encoded or not): 400 naming it if refused."""
    problem = session_id_problem(session)
    if problem is not None:
        raise InvalidRequest(f"session: the session id {problem}", param="session")
    return session


def peer_only(request: Request, node: NodeDep) -> Node:
    """Dependency of peer routes: the caller must present the mesh secret."""
    if not check_peer_token(request.headers.get(PEER_HEADER), node.mesh.secrets):
        raise Unauthorized("peer calls need the mesh secret")
    return node


def admin_only(node: NodeDep, authorization: Annotated[str | None, Header()] = None) -> Node:
    """Dependency of admin routes: the caller must present the admin token."""
    admin_token = node.cfg.admin_token.get_secret_value() if node.cfg.admin_token else None
    if admin_token is None:
        raise Unauthorized("admin actions are disabled: this node has no admin_token configured")
    if not check_bearer(authorization, admin_token):
        raise Unauthorized("missing or wrong admin token (Authorization: Bearer ...)")
    return node


PeerNode = Annotated[Node, Depends(peer_only)]
AdminNode = Annotated[Node, Depends(admin_only)]


def _check_host(node: Node, host: str) -> None:
    """404 unless `host` is this host or one of its peers."""
    if host != node.name and host not in node.mesh.peers.peers:
        raise NotFound(f"no host {host!r} in this mesh; hosts: {', '.join([node.name, *node.mesh.peers.peers])}")


# ---- read-only views -------------------------------------------------------


def _cluster(node: Node) -> ClusterView:
    """This node's view, marked partial past the directory threshold (node.mesh.clusterview)."""
    return scoped(node.mesh.cluster(), len(node.mesh.members()), node.mesh.directory_after_hosts)


@router.get("/v1/cluster")
async def cluster(node: NodeDep, scope: Literal["node", "mesh"] = "node") -> Response:
    """This node's view (`scope` in the answer says whether it is the whole mesh); `?scope=mesh`: a fan-in
    over every host, for a mesh past the directory threshold (node.mesh.clusterview)."""
    snap = _cluster(node)
    if scope == "mesh" and snap.scope == "partial":
        peers = [(p.name, p.cfg.api) for p in node.mesh.peers.peers.values()]
        snap = await mesh_wide(snap, peers, node.mesh.peers.client)
    return _json(snap.model_dump_json())


@router.get("/v1/stats")
async def stats(node: NodeDep) -> dict[str, Any]:
    return node.stats()


@router.get("/metrics")
async def metrics(node: NodeDep) -> Response:
    body, ctype = node.render_metrics()
    return Response(body, media_type=ctype)


@router.websocket("/v1/events")
async def events(ws: WebSocket, node: NodeDep) -> None:
    """A snapshot of the cluster, the replay ring, then live events (cut off if the consumer lags)."""
    await ws.accept()
    sub, replay = node.hub.subscribe()
    try:
        snap = node.hub.stamp(ClusterViewEvent(cluster=_cluster(node)))
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


# ---- peer calls (mesh secret) ----------------------------------------------


@router.get("/v1/peer/status")
async def peer_status(node: PeerNode) -> Response:
    return _json(node.mesh.local_status().model_dump_json())


@router.websocket("/v1/peer/state")
async def peer_state(ws: WebSocket, node: NodeDep, subscriber: str = "") -> None:
    """This host's state pushed to one peer: a snapshot, then deltas (node.mesh.statestream)."""
    if not check_peer_token(ws.headers.get(PEER_HEADER), node.mesh.secrets):
        await ws.close(code=1008, reason="peer calls need the mesh secret")  # before accept: HTTP 403
        return
    await ws.accept()
    cfg = node.cfg.mesh
    feed = StateFeed(node.hub.epoch, scope=node.mesh.scope_for(subscriber) if subscriber else None)
    # Every event this node publishes (a turn started or ended, a replica sent or landed) is a change
    # a peer's placement should see now, not at the next interval.
    sub, _ = node.hub.subscribe()
    wake = asyncio.Event()

    async def watch() -> None:
        while await sub.get() is not None:
            wake.set()

    watcher = asyncio.create_task(watch())
    try:
        await push(ws.send_text, ws.receive_text, node.mesh.local_status, feed,
                   interval_s=cfg.push_interval_s, heartbeat_s=cfg.heartbeat_s, wake=wake)
    except (WebSocketDisconnect, RuntimeError):
        return
    finally:
        watcher.cancel()
        sub.close()


@router.get("/v1/peer/directory/{session:path}")
async def peer_directory(session: str, node: PeerNode) -> Response:
    """What this host knows every host holds of a session (it is the session's directory host)."""
    return _json(node.mesh.directory_entry(_valid_session(session)).model_dump_json())


class HelloRequest(BaseModel):
    nonce: str = Field(min_length=16, max_length=128, pattern=r"^[0-9a-f]+$")


@router.post("/v1/peer/hello")
async def peer_hello(body: HelloRequest, node: PeerNode) -> PeerHello:
    """Who this host is, signed over the caller's nonce (DNS discovery admits a host on it)."""
    secrets = node.cfg.mesh.secrets()
    if not secrets:
        raise Conflict("this node has no mesh secret: it cannot prove membership")
    kvshare_port = int(node.kvshare.address.rsplit(":", 1)[1])
    return hello(node.name, node.api_port(), kvshare_port, "https" if node.cfg.api.tls else "http", secrets[0],
                 body.nonce)


@router.get("/v1/peer/sessions/{session:path}")
async def peer_session(session: str, node: PeerNode) -> Response:
    return _json(node.mesh.local_holding(_valid_session(session)).model_dump_json())


@router.post("/v1/peer/drain")
async def peer_drain(node: PeerNode) -> ActionResult:
    return await node.operator.host_action("drain")


@router.post("/v1/peer/undrain")
async def peer_undrain(node: PeerNode) -> ActionResult:
    return await node.operator.host_action("undrain")


@router.post("/v1/peer/sessions/{session:path}/adopt")
async def peer_adopt(session: str, node: PeerNode, seq: int = 0) -> ActionResult:
    _valid_session(session)
    node.mesh.book.adopt(session, seq or node.mesh.next_seq(session))
    return ActionResult(ok=True, message=f"{node.name} is now home of {session}")


@router.post("/v1/peer/sessions/{session:path}/migrate")
async def peer_migrate(session: str, target: str, node: PeerNode) -> ActionResult:
    return await node.operator.migrate(_valid_session(session), target, relay=False)


@router.post("/v1/peer/sessions/{session:path}/replicate")
async def peer_replicate(session: str, node: PeerNode) -> ActionResult:
    return await node.operator.replicate_now(_valid_session(session), relay=False)


# ---- admin (admin token) -----------------------------------------------------


async def _on_host(node: Node, host: str, action: str) -> ActionResult:
    """Run a host action here, or relay it (peer-authenticated) to the host it names."""
    _check_host(node, host)
    if host == node.name:
        return await node.operator.host_action(action)
    try:
        return await relay_action(node.mesh, host, f"/v1/peer/{action}", timeout_s=HOST_RELAY_TIMEOUT_S)
    except RelayFailed as e:
        if e.status is not None:
            raise Conflict(f"host {host} refused {action}: {e.reason}") from None
        raise Conflict(f"host {host} did not answer: {e.reason}") from None


@router.post("/v1/admin/hosts/{host}/drain")
async def drain(host: str, node: AdminNode) -> ActionResult:
    return await _on_host(node, host, "drain")


@router.post("/v1/admin/hosts/{host}/undrain")
async def undrain(host: str, node: AdminNode) -> ActionResult:
    return await _on_host(node, host, "undrain")


@router.post("/v1/admin/sessions/{session:path}/migrate")
async def migrate(session: str, node: AdminNode, cmd: Annotated[MigrateCommand | None, Body()] = None,
                  target: str | None = None) -> ActionResult:
    dst = (cmd.target if cmd else None) or target
    if not dst:
        raise Conflict('migrate needs a target host: JSON body {"target": "<host>"}')
    _check_host(node, dst)
    return await node.operator.migrate(_valid_session(session), dst)


@router.post("/v1/admin/sessions/{session:path}/replicate")
async def replicate(session: str, node: AdminNode) -> ActionResult:
    return await node.operator.replicate_now(_valid_session(session))
