"""Observer routes: the cluster view, the event stream the console reads, stats and metrics.

They change nothing, but the cluster view, the stats and the event stream name every session (often a user
or a repository) and every host, so with client keys configured they want one (node.api.clientauth), as the
client routes do; the mesh's peer token is accepted too. `/metrics` stays open for scrapers: its series are
counts by host and reason, never a session id.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response

from kvmesh.node.api.clientauth import ClientKey, key_problem, passed_key
from kvmesh.node.api.deps import NodeDep, json_response
from kvmesh.node.api.errors import kvmesh_error_response
from kvmesh.node.api.jsonbody import StrictJSONRoute
from kvmesh.node.errors import Unauthorized
from kvmesh.node.mesh.clusterview import mesh_wide, scoped
from kvmesh.node.node import Node
from kvmesh.node.protocol import ClusterView, ClusterViewEvent

router = APIRouter(route_class=StrictJSONRoute)

# The ASGI extension that lets a websocket handshake be answered with a plain HTTP response.
DENIAL_EXTENSION = "websocket.http.response"


def _cluster(node: Node) -> ClusterView:
    """This node's view, marked partial past the directory threshold (node.mesh.clusterview)."""
    return scoped(node.mesh.cluster(), len(node.mesh.members()), node.mesh.directory_after_hosts)


@router.get("/v1/cluster", dependencies=[ClientKey])
async def cluster(request: Request, node: NodeDep, scope: Literal["node", "mesh"] = "node") -> Response:
    """This node's view (`scope` in the answer says whether it is the whole mesh); `?scope=mesh`: a fan-in
    over every host, for a mesh past the directory threshold (node.mesh.clusterview)."""
    snap = _cluster(node)
    if scope == "mesh" and snap.scope == "partial":
        peers = [(p.name, p.cfg.api) for p in node.mesh.peers.peers.values()]
        # The peer client presents the peer token when the mesh has a secret; without one, the caller's own key
        # is what every host accepts.
        snap = await mesh_wide(snap, peers, node.mesh.peers.client, headers=passed_key(request))
    return json_response(snap.model_dump_json())


@router.get("/v1/stats", dependencies=[ClientKey])
async def stats(node: NodeDep) -> dict[str, Any]:
    return node.stats()


@router.get("/metrics")
async def metrics(node: NodeDep) -> Response:
    body, ctype = node.render_metrics()
    return Response(body, media_type=ctype)


async def _refuse(ws: WebSocket, problem: str) -> None:
    """Refuse the handshake before it is accepted: an HTTP 401 with the OpenAI-shaped error body, which websocket
    clients report as the handshake's status (websockets: InvalidStatus, 401). A server without the denial
    extension can only refuse with 403, so the close says why in its reason as well."""
    if DENIAL_EXTENSION in ws.scope.get("extensions", {}):
        await ws.send_denial_response(kvmesh_error_response(Unauthorized(problem), "/v1/events"))
    else:
        await ws.close(code=1008, reason=problem)


@router.websocket("/v1/events")
async def events(ws: WebSocket, node: NodeDep) -> None:
    """A snapshot of the cluster, the replay ring, then live events (cut off if the consumer lags)."""
    problem = key_problem(ws, node)
    if problem is not None:
        await _refuse(ws, problem)
        return
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
