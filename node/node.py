"""The node agent: one host's engine plus everything around it.

`Node` is what the API serves and the CLI starts. The mesh and kv_share parts
attach here as they land; each keeps its own state and talks to the engine
only through the engine's public methods.
"""

from __future__ import annotations

import hashlib
import logging
import time

from node.config import NodeConfig
from node.engine.engine import Engine
from node.errors import InvalidRequest
from node.protocol import is_valid_session_id

log = logging.getLogger("kvmesh.node")


def derive_session_id(header: str | None, user: str | None, messages: list[dict[str, object]]) -> str:
    """X-Session-Id header, else the request's `user`, else a hash of the first system+user message."""
    if header is not None:
        if not is_valid_session_id(header):
            raise InvalidRequest(
                "X-Session-Id must be 1-128 characters of A-Z a-z 0-9 . _ : @ - (and not '.' or '..')",
                param="X-Session-Id",
            )
        return header
    if user:
        # `user` is free text in the OpenAI API: used as is when it is a safe id, hashed otherwise.
        return user if is_valid_session_id(user) else "user-" + hashlib.sha256(user.encode()).hexdigest()[:20]
    first = [m for m in messages if m.get("role") in ("system", "developer")][:1]
    first += [m for m in messages if m.get("role") == "user"][:1]
    blob = repr([(m.get("role"), m.get("content")) for m in first]).encode()
    return "conv-" + hashlib.sha256(blob).hexdigest()[:20]


class Node:
    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.name = cfg.name
        self.started = time.time()
        self.engine = Engine(cfg.engine)
        log.info(
            "node %s: engine %s, %d slots, %d KV blocks of %d tokens (%.1f MiB each), fingerprint %s",
            self.name, cfg.engine.kind, cfg.engine.slots, self.engine.pool.num_blocks, self.engine.block_size,
            self.engine.block_bytes / 2**20, self.engine.fingerprint[:12],
        )

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self.engine.close()

    def health(self) -> dict[str, object]:
        s = self.engine.slots
        return {
            "status": "ok",
            "node": self.name,
            "model": self.engine.model_name,
            "slots": s.slots,
            "busy": s.busy,
            "queued": s.queued,
            "uptime_s": round(time.time() - self.started, 1),
        }
