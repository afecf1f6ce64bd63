"""kv_share's signed OFFER header and the limits a receiver holds an offer to.

`Offer` is the JSON the sender signs (the frame layouts are in `frames`); a session id is
checked here before anything names a file by it. Public through `kvmesh.node.kvshare.wire`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from kvmesh.node.errors import InvalidRequest
from kvmesh.node.protocol import SessionId, session_id_problem


class InvalidSessionId(InvalidRequest):
    """Not a session id (empty, over-long, a control character: `protocol.session_id_problem`)."""

    code = "invalid_session_id"


def check_session_id(session: object) -> str:
    """The id itself, or `InvalidSessionId` (before anything touches a disk). Files are named by
    `protocol.session_key(id)`, never by the id, so any printable id is safe here."""
    problem = session_id_problem(session)
    if problem is not None:
        raise InvalidSessionId(f"session id {repr(session)[:40]} {problem}", param="session")
    return session  # type: ignore[return-value]


# ---- header, limits ------------------------------------------------------------


class Offer(BaseModel):
    """The OFFER header: what the sender holds for one session, at one generation."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    session: SessionId
    sender: str = Field(min_length=1, max_length=128)
    fingerprint: str = Field(min_length=1, max_length=128)
    block_size: int = Field(ge=1, le=1 << 20)
    block_bytes: int = Field(ge=1, le=1 << 40)
    n_blocks: int = Field(ge=0, le=1 << 32)
    generation: int = Field(ge=0, le=(1 << 63) - 1)
    sent_at: float = Field(allow_inf_nan=False)
    # The state snapshot that follows the blocks (window cells, recurrent state: node.engine.snapshots), signed
    # here so a receiver knows its size before a byte of it arrives; 0 and 0: the replica is blocks alone.
    snapshot_pos: int = Field(0, ge=0, le=(1 << 32) - 1)
    snapshot_bytes: int = Field(0, ge=0, le=1 << 40)

    @property
    def num_tokens(self) -> int:
        return self.n_blocks * self.block_size


@dataclass(frozen=True)
class Limits:
    """What a receiver will buffer for one transfer; beyond any of these: 'oversized'."""

    max_header_bytes: int = 64 << 10
    max_blocks: int = 1 << 16
    max_tokens: int = 1 << 22
    max_block_bytes: int = 64 << 20
    max_snapshot_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_blocks", "max_tokens", "max_block_bytes", "max_snapshot_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be positive")
