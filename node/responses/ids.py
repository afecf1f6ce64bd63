"""A stored response's id, and whose it is.

An id is `resp_`, 32 random hex digits, then the key of the conversation it belongs to (node.mesh.threads),
base64url without padding. The key is a routing hint, never a credential: from the id alone any entry node
knows which conversation to look in, and so which hosts to ask (its home and replica holders,
node.responses.service), with no directory of responses. It grants nothing: a response is found only by its
whole id, the random part is not guessable, and it is shown only to the scope that made it (`scope_of`), so an
id edited to name another conversation finds nothing, exactly as an unknown one.

A scope is a digest of the API key that made the response (the key itself is never kept): another key's
caller gets the 404 an unknown id gets. With no keys configured every caller shares the one scope "".
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import secrets

from kvmesh.node.sessionids import is_valid_session_id

PREFIX = "resp_"
NONCE_HEX = 32
_NONCE = re.compile(r"[0-9a-f]{32}")
MAX_ID_CHARS = len(PREFIX) + NONCE_HEX + 344  # a 256-byte key is 344 base64 characters
PEER_SCOPE = "peer"  # a caller with keys configured who came with the mesh's peer token instead of a key


def new_id(session: str) -> str:
    """A fresh response id for conversation `session`."""
    key = base64.urlsafe_b64encode(session.encode("utf-8")).rstrip(b"=").decode("ascii")
    return PREFIX + secrets.token_hex(NONCE_HEX // 2) + key


def session_of(response_id: str) -> str | None:
    """The conversation a response id names, or None when it is no id of ours (found nowhere)."""
    if len(response_id) > MAX_ID_CHARS or not response_id.startswith(PREFIX):
        return None
    nonce, key = response_id[len(PREFIX): len(PREFIX) + NONCE_HEX], response_id[len(PREFIX) + NONCE_HEX:]
    if not _NONCE.fullmatch(nonce) or not key:
        return None
    try:
        session = base64.urlsafe_b64decode(key + "=" * (-len(key) % 4)).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    return session if is_valid_session_id(session) else None


def scope_of(key: str | None, *, keyed: bool) -> str:
    """Whose a response is: "" on a node with no keys, else a digest of the caller's key (PEER_SCOPE with none)."""
    if not keyed:
        return ""
    if key is None:
        return PEER_SCOPE
    return hashlib.sha256(b"kvmesh/responses/scope\x00" + key.encode("utf-8", "surrogatepass")).hexdigest()[:32]
