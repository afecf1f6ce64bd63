"""Admin routes: an operator's actions (drain and undrain a host, migrate or replicate a session).

Each needs the admin token (`Authorization: Bearer ...`), never logged or echoed. The actions are
node.mesh.actions' (`Node.operator`); an action on another host is relayed to it with the mesh secret.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, Header

from kvmesh.node.api.deps import NodeDep, valid_session
from kvmesh.node.api.jsonbody import StrictJSONRoute
from kvmesh.node.errors import Conflict, NotFound, Unauthorized
from kvmesh.node.mesh.actions import RelayFailed, relay_action
from kvmesh.node.mesh.auth import check_bearer
from kvmesh.node.node import Node
from kvmesh.node.protocol import ActionResult, MigrateCommand

# A host action answers at once (a drain runs on after it), so a relay of one waits briefly.
HOST_RELAY_TIMEOUT_S = 10.0

router = APIRouter(route_class=StrictJSONRoute)


def admin_only(node: NodeDep, authorization: Annotated[str | None, Header()] = None) -> Node:
    """Dependency of admin routes: the caller must present the admin token."""
    admin_token = node.cfg.admin_token.get_secret_value() if node.cfg.admin_token else None
    if admin_token is None:
        raise Unauthorized("admin actions are disabled: this node has no admin_token configured")
    if not check_bearer(authorization, admin_token):
        raise Unauthorized("missing or wrong admin token (Authorization: Bearer ...)")
    return node


AdminNode = Annotated[Node, Depends(admin_only)]


def _check_host(node: Node, host: str) -> None:
    """404 unless `host` is this host or one of its peers."""
    if host != node.name and host not in node.mesh.peers.peers:
        raise NotFound(f"no host {host!r} in this mesh; hosts: {', '.join([node.name, *node.mesh.peers.peers])}")


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
    return await node.operator.migrate(valid_session(session), dst)


@router.post("/v1/admin/sessions/{session:path}/replicate")
async def replicate(session: str, node: AdminNode) -> ActionResult:
    return await node.operator.replicate_now(valid_session(session))
