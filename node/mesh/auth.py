"""Shared-secret checks for peer calls and admin calls (constant-time, rotation-aware)."""

from __future__ import annotations

import hashlib
import hmac

PEER_HEADER = "X-Kvmesh-Peer-Auth"


def peer_token(secret: bytes) -> str:
    """What a node presents to its peers: an HMAC of a fixed label, never the secret itself."""
    return hmac.new(secret, b"kvmesh/peer/v1", hashlib.sha256).hexdigest()


def check_peer_token(presented: str | None, secrets: list[bytes]) -> bool:
    """True if `presented` matches the current or the previous secret. With no secret
    configured the mesh is loopback-only (enforced at bind time) and peers are trusted."""
    if not secrets:
        return True
    if not presented:
        return False
    ok = False
    for s in secrets:
        ok |= hmac.compare_digest(presented.encode(), peer_token(s).encode())
    return ok


def check_bearer(authorization: str | None, token: str | None) -> bool:
    """Admin calls: `Authorization: Bearer <token>`; refused when no token is configured."""
    if token is None or not authorization or not authorization.startswith("Bearer "):
        return False
    return hmac.compare_digest(authorization[7:].encode(), token.encode())
