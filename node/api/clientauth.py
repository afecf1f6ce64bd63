"""Client API keys on the client routes (chat, completions, messages, count_tokens, responses, models).

With no key configured (api.keys, KVMESH_API_KEY) the routes are open, as before. With keys, a
request presents one as `Authorization: Bearer <key>` (OpenAI SDKs) or `x-api-key: <key>`
(Anthropic SDKs); anything else is a 401 in the dialect's own error shape. A turn a peer
forwards carries the mesh's peer token instead (with a mesh secret set) or the client's key as
sent. Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, Request

from kvmesh.node.api.deps import NodeDep
from kvmesh.node.errors import Unauthorized
from kvmesh.node.mesh.auth import PEER_HEADER, check_peer_token


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def check_client_key(request: Request, node: NodeDep) -> None:
    """Raise Unauthorized unless the request presents an accepted key (or no key is configured)."""
    keys = node.client_keys
    if not keys:
        return
    if node.cfg.mesh.secrets() and check_peer_token(request.headers.get(PEER_HEADER), node.cfg.mesh.secrets()):
        return
    key = presented_key(request)
    if key is None:
        raise Unauthorized("this node needs an API key: send Authorization: Bearer <key> or x-api-key: <key>")
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(key.encode(), k.encode())
    if not ok:
        raise Unauthorized("the API key is not accepted here")


# Route dependency: `dependencies=[ClientKey]`.
ClientKey = Depends(check_client_key)
