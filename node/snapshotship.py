"""Snapshots to peers: after a replica of a session lands on a peer, the newest snapshot its blocks
reach follows it (`node.engine.snapshots`: window mode, hybrid models), to `/v1/peer/snapshots`.

The blocks alone resume nothing on such a model, so the pair is the replica; a snapshot that does
not arrive leaves the peer resuming at an older one, or recomputing: never a failed turn.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable

import httpx
import numpy as np

from kvmesh.node.engine.snapshots import Snapshot, Snapshots, decode_snapshot, encode_snapshot
from kvmesh.node.errors import ImportRefused, InvalidRequest

log = logging.getLogger("kvmesh.snapshots")

FINGERPRINT_HEADER = "x-kvmesh-fingerprint"
DIGEST_HEADER = "x-kvmesh-digest"
MAX_BODY_BYTES = 1 << 30


class SnapshotShipper:
    """Sends a session's newest snapshot to a peer, takes in a peer's; counts both."""

    def __init__(self, snapshots: Snapshots, fingerprint: str, *, client: Callable[[], httpx.AsyncClient],
                 api_of: Callable[[str], str | None], tokens_of: Callable[[str], np.ndarray | None]):
        self.snapshots, self.fingerprint = snapshots, fingerprint
        self._client, self._api_of, self._tokens_of = client, api_of, tokens_of
        self.sent = self.sent_bytes = self.failed = 0
        self.in_flight = 0  # sends not yet answered: a draining node waits for them

    def submit(self, session: str, target: str, upto: int) -> asyncio.Task[bool]:
        """Send the newest snapshot of `session` within its first `upto` tokens (what the replica holds) to
        `target`, in a task; counted in flight from now, so a drain that asks next already waits for it."""
        self.in_flight += 1
        return asyncio.ensure_future(self._ship(session, target, upto))

    async def _ship(self, session: str, target: str, upto: int) -> bool:
        try:
            tokens, api = self._tokens_of(session), self._api_of(target)
            w = None if tokens is None else self.snapshots.newest(tokens, upto)
            if w is None or api is None or tokens is None:
                return False
            return await self._send(session, target, api, tokens[: w.pos], w)
        finally:
            self.in_flight -= 1

    async def _send(self, session: str, target: str, api: str, tokens: np.ndarray, w: Snapshot) -> bool:
        body = await asyncio.to_thread(encode_snapshot, tokens, w.blob)
        digest = await asyncio.to_thread(lambda: hashlib.sha256(body).hexdigest())
        try:
            r = await self._client().post(f"{api}/v1/peer/snapshots", content=body, timeout=30.0,
                                          headers={FINGERPRINT_HEADER: self.fingerprint, DIGEST_HEADER: digest})
            r.raise_for_status()
        except httpx.HTTPError as e:
            self.failed += 1
            log.warning("snapshot of %s at %d to %s failed: %s", session, w.pos, target, e)
            return False
        self.sent += 1
        self.sent_bytes += len(body)
        return True

    async def accept(self, body: bytes, fingerprint: str | None, digest: str | None) -> int:
        """Keep a peer's snapshot once its digest, model fingerprint and cells check; returns its position.
        Raises InvalidRequest (malformed) or ImportRefused (another model, a wrong digest, wrong cells)."""
        if fingerprint != self.fingerprint:
            raise ImportRefused(f"model fingerprint {(fingerprint or '-')[:12]} is not this engine's {self.fingerprint[:12]}",
                                reason="fingerprint")
        if digest is None or await asyncio.to_thread(lambda: hashlib.sha256(body).hexdigest()) != digest:
            raise ImportRefused(f"the body's sha256 is not the {DIGEST_HEADER} header's", reason="digest")
        try:
            tokens, blob = decode_snapshot(body)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        why = await asyncio.to_thread(self.snapshots.put, tokens, blob, received=True)
        if why is not None:
            raise ImportRefused(why, reason="snapshot")
        return len(tokens)

    def stats(self) -> dict[str, int]:
        return {**self.snapshots.stats(), "sent": self.sent, "sent_bytes": self.sent_bytes, "send_failed": self.failed}
