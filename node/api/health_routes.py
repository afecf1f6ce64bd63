"""Health routes, for whoever watches the node (load balancers, Kubernetes, operators), not clients:
`/health` (alive) and `/ready` (taking clients). Neither asks for an API key."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from kvmesh.node.api.deps import NodeDep
from kvmesh.node.api.jsonbody import StrictJSONRoute

router = APIRouter(route_class=StrictJSONRoute)


@router.get("/health")
async def health(node: NodeDep) -> dict[str, object]:
    return node.health()


@router.get("/ready", response_model=None)
async def ready(node: NodeDep) -> Response:
    """Readiness for load balancers and Kubernetes: 200 while this node takes clients, 503 once it
    drains or stops (SIGTERM), so traffic leaves before the node does. /health stays 200 (alive)."""
    ok = node.ready()
    return JSONResponse({"ready": ok, "status": node.health()["status"], "node": node.name}, status_code=200 if ok else 503)
