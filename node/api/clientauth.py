"""Client API keys on the client routes (chat, completions, messages, count_tokens, responses, models) and
the observer routes (`/v1/cluster`, `/v1/stats`, the `/v1/events` websocket), which list every session id.

With no key configured (api.keys, KVMESH_API_KEY) the routes are open, as before. With keys, a
request presents one as `Authorization: Bearer <key>` (OpenAI SDKs) or `x-api-key: <key>`
(Anthropic SDKs); anything else is a 401 in the dialect's own error shape. A turn a peer
forwards carries the mesh's peer token instead (with a mesh secret set) or the client's key as
sent. Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, Request
from starlette.requests import HTTPConnection

from kvmesh.node.api.deps import NodeDep
from kvmesh.node.errors import Unauthorized
from kvmesh.node.mesh.auth import PEER_HEADER, check_peer_token
from kvmesh.node.node import Node

# The headers a client's key may come in (node.mesh.turn passes the same ones on to a peer).
KEY_HEADERS = ("authorization", "x-api-key")


def presented_key(conn: HTTPConnection) -> str | None:
    auth = conn.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return conn.headers.get("x-api-key")


def key_problem(conn: HTTPConnection, node: Node) -> str | None:
    """Why `conn` (a request or a websocket handshake) may not in, or None if it may (or no key is configured)."""
    keys = node.client_keys
    if not keys:
        return None
    if node.cfg.mesh.secrets() and check_peer_token(conn.headers.get(PEER_HEADER), node.cfg.mesh.secrets()):
        return None
    key = presented_key(conn)
    if key is None:
        return "this node needs an API key: send Authorization: Bearer <key> or x-api-key: <key>"
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(key.encode(), k.encode())
    return None if ok else "the API key is not accepted here"


def check_client_key(request: Request, node: NodeDep) -> None:
    """Raise Unauthorized unless the request presents an accepted key (or no key is configured)."""
    problem = key_problem(request, node)
    if problem is not None:
        raise Unauthorized(problem)


def passed_key(conn: HTTPConnection) -> dict[str, str]:
    """The key headers `conn` came with, to present on a call to a peer on its behalf (every host of a mesh
    accepts the same keys; with a mesh secret the peer token would do, without one only the key does)."""
    return {h: conn.headers[h] for h in KEY_HEADERS if h in conn.headers}


# Route dependency: `dependencies=[ClientKey]`.
ClientKey = Depends(check_client_key)
