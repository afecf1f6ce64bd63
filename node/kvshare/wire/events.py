"""kv_share's events: what `Receiver` and `Sender` return from the bytes they are fed.

Plain frozen dataclasses, no behaviour; `PayloadTarget` is the hook through which a receiver's
caller lands payloads in place. Public through `kvmesh.node.kvshare.wire`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvmesh.node.kvshare.wire.header import Offer

# ---- events ----------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class OfferReceived:
    """An authenticated, well-formed offer; answer with `accept()` or `refuse()`."""

    offer: Offer
    tokens: np.ndarray  # int32, n_blocks * block_size
    hashes: list[bytes]


@dataclass(frozen=True)
class BlockHeader:
    """A BLOCK frame's header: its index and chain hash already checked against the offer."""

    index: int
    chain_hash: bytes
    digest: bytes


@dataclass(frozen=True, eq=False)
class BlockReceived:
    """A block whose payload landed in `data` and matched its digest."""

    index: int
    chain_hash: bytes
    digest: bytes
    data: memoryview


@dataclass(frozen=True, eq=False)
class SnapshotReceived:
    """The snapshot the offer announced (after its last block), whose payload matched its digest."""

    pos: int
    digest: bytes
    data: memoryview


@dataclass(frozen=True)
class EndReceived:
    """Every offered block arrived and the END mac authenticates their digests."""

    count: int


@dataclass(frozen=True)
class Refused:
    """This receiver refuses the transfer; send `reply` and close."""

    reason: str
    message: str
    reply: bytes


@dataclass(frozen=True)
class Accepted:
    """The receiver lacks blocks from `first_missing` on: stream those."""

    first_missing: int


@dataclass(frozen=True)
class Completed:
    """The receiver holds the replica: `tokens` of the session are now resident there."""

    tokens: int


@dataclass(frozen=True)
class PeerRefused:
    """The receiver refused (at the answer or the result); `authenticated` if signed."""

    stage: str  # "answer" | "result"
    reason: str
    message: str
    authenticated: bool


ReceiverEvent = OfferReceived | BlockHeader | BlockReceived | SnapshotReceived | EndReceived | Refused
SenderEvent = Accepted | Completed | PeerRefused
PayloadTarget = Callable[[BlockHeader], "memoryview | None"]
