"""Peer routes: what hosts of the mesh ask each other (status, pushed state, the directory, hello,
actions relayed from an admin, a conversation's stored responses). Every one needs the mesh secret (`X-Kvmesh-Peer-Auth`), never logged
or echoed.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response
from pydantic import BaseModel, Field

from kvmesh.node.api.deps import NodeDep, json_response, valid_session
from kvmesh.node.api.jsonbody import StrictJSONRoute
from kvmesh.node.errors import Conflict, InvalidRequest, NotFound, Unauthorized
from kvmesh.node.mesh.auth import PEER_HEADER, check_peer_token
from kvmesh.node.mesh.discovery import hello
from kvmesh.node.mesh.statefeed import StateFeed
from kvmesh.node.mesh.statestream import push
from kvmesh.node.node import Node
from kvmesh.node.protocol import ActionResult, PeerHello
from kvmesh.node.responses.record import StoredRecord

router = APIRouter(route_class=StrictJSONRoute)


def peer_only(request: Request, node: NodeDep) -> Node:
    """Dependency of peer routes: the caller must present the mesh secret."""
    if not check_peer_token(request.headers.get(PEER_HEADER), node.mesh.secrets):
        raise Unauthorized("peer calls need the mesh secret")
    return node


PeerNode = Annotated[Node, Depends(peer_only)]


@router.get("/v1/peer/status")
async def peer_status(node: PeerNode) -> Response:
    return json_response(node.mesh.local_status().model_dump_json())


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
    return json_response(node.mesh.directory_entry(valid_session(session)).model_dump_json())


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
    return json_response(node.mesh.local_holding(valid_session(session)).model_dump_json())


@router.post("/v1/peer/drain")
async def peer_drain(node: PeerNode) -> ActionResult:
    return await node.operator.host_action("drain")


@router.post("/v1/peer/undrain")
async def peer_undrain(node: PeerNode) -> ActionResult:
    return await node.operator.host_action("undrain")


@router.post("/v1/peer/sessions/{session:path}/adopt")
async def peer_adopt(session: str, node: PeerNode, seq: int = 0) -> ActionResult:
    valid_session(session)
    node.mesh.book.adopt(session, seq or node.mesh.next_seq(session))
    return ActionResult(ok=True, message=f"{node.name} is now home of {session}")


@router.post("/v1/peer/sessions/{session:path}/migrate")
async def peer_migrate(session: str, target: str, node: PeerNode) -> ActionResult:
    return await node.operator.migrate(valid_session(session), target, relay=False)


@router.post("/v1/peer/sessions/{session:path}/replicate")
async def peer_replicate(session: str, node: PeerNode) -> ActionResult:
    return await node.operator.replicate_now(valid_session(session), relay=False)


@router.get("/v1/peer/responses/{session:path}")
async def peer_responses(session: str, node: PeerNode) -> Response:
    """A conversation's stored responses as this host keeps them (node.responses.service), every scope's."""
    record = node.responses.record(valid_session(session))
    if record is None:
        raise NotFound("no stored responses of that conversation here")
    return json_response(await asyncio.to_thread(record.model_dump_json))


@router.put("/v1/peer/responses/{session:path}")
async def peer_keep_responses(session: str, body: StoredRecord, node: PeerNode, replicate: bool = False,
                              known_only: bool = False) -> ActionResult:
    """Merge a copy of a conversation's stored responses; `replicate`: this host ran its turn, so it passes the
    record on to the conversation's replica holder before answering; `known_only`: only into a record held here."""
    if body.session != valid_session(session):
        raise InvalidRequest("the record names another conversation than the path", param="session")
    await node.responses.accept(body, replicate=replicate, known_only=known_only)
    return ActionResult(ok=True, message=f"{node.name} keeps the stored responses of {session}")
