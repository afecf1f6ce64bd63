"""kv_share: delta replicas of sessions' KV caches, on the wire and on disk.

`wire` is the sans-I/O protocol (a `Sender` and a `Receiver` that turn bytes
into events and back); `store` is the on-disk `ReplicaStore`. Sockets, the
listener and the planning of what to send live elsewhere and build on these.
"""

from __future__ import annotations

from kvmesh.node.kvshare.store import FsyncPolicy, Manifest, ReplicaStore, Segment, SegmentWriter, StoreError
from kvmesh.node.kvshare.wire import (
    BLOCK_HEADER_BYTES,
    VERSION,
    Accepted,
    BlockHeader,
    BlockReceived,
    Completed,
    EndReceived,
    InvalidSessionId,
    Limits,
    Offer,
    OfferReceived,
    PeerRefused,
    ProtocolError,
    Reason,
    Receiver,
    ReceiverEvent,
    Refused,
    Sender,
    SenderEvent,
    check_session_id,
    is_valid_session_id,
)

__all__ = [
    "BLOCK_HEADER_BYTES",
    "VERSION",
    "Accepted",
    "BlockHeader",
    "BlockReceived",
    "Completed",
    "EndReceived",
    "FsyncPolicy",
    "InvalidSessionId",
    "Limits",
    "Manifest",
    "Offer",
    "OfferReceived",
    "PeerRefused",
    "ProtocolError",
    "Reason",
    "Receiver",
    "ReceiverEvent",
    "Refused",
    "ReplicaStore",
    "Segment",
    "SegmentWriter",
    "Sender",
    "SenderEvent",
    "StoreError",
    "check_session_id",
    "is_valid_session_id",
]
