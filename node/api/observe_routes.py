"""Observer routes: the cluster view, the event stream the console reads, stats and metrics.

Open to whoever can reach the API (behind the client API key when one is set): they change nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import Response

from kvmesh.node.api.deps import NodeDep, json_response
from kvmesh.node.mesh.clusterview import mesh_wide, scoped
from kvmesh.node.node import Node
from kvmesh.node.protocol import ClusterView, ClusterViewEvent

router = APIRouter()


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
    return json_response(snap.model_dump_json())


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
