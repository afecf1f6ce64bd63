"""kv_share wire protocol, version 2: encoders and incremental decoders, no I/O.

One transfer is one TCP connection from a sender to a receiver, for one
(session, generation). Nothing here touches a socket, a file or an event loop:
bytes go in, events come out, and the bytes to send back are returned to the
caller, so the same code serves asyncio, threads and tests.

Sender -> receiver::

    OFFER  b"KVSH" | version u8 | kind u8 | header_len u32 | n_tokens u32 | n_hashes u32
           | header JSON (`Offer`) | tokens (int32 LE) | hashes (16 B each)
           | HMAC-SHA256(secret, everything before it)
           The header's `session` is the id itself, as the client sent it (UTF-8 JSON
           inside the length-prefixed header); a receiver names nothing by it: its
           store files go by `protocol.session_key(session)`.
    BLOCK  kind u8 | index u32 | chain hash 16 B | payload digest 16 B | payload (block_bytes)
    SNAP   kind u8 | position u32 | size u64 | payload digest 16 B | payload (size)
           Only when the offer's signed header announces one (`snapshot_pos`, `snapshot_bytes`),
           once, after the last block: the state a sliding-window or recurrent model resumes
           from at that position (node.engine.snapshots), the half of its replica that is not
           blocks. Its position names it: the offer's tokens before it.
    END    kind u8 | block count u32 | HMAC(secret, offer mac || payload digests in order,
           the snapshot's last)

Version 2 added SNAP (and the two header fields); a receiver refuses an offer of
another version ('version'), so a peer of the other version recomputes, never misreads.

Receiver -> sender::

    ANSWER b"KVSH" | version u8 | kind u8 | status u8 | first_missing u32
           | reason_len u16 | message_len u16 | reason | message | mac
    RESULT kind u8 | status u8 | tokens u64 | reason_len u16 | message_len u16
           | reason | message | mac

The receiver's replies carry HMAC(secret, offer mac || reply without its mac)
with the key that authenticated the offer, so an accepted answer or an "ok"
result cannot be forged or replayed from another transfer. A refusal sent
before the offer was authenticated has no key to sign with; its mac is zeros
and the sender reports it as unauthenticated (a forged refusal can only do
what cutting the connection does anyway).

Two kinds of failure, both final for the connection:

* `ProtocolError` (raised): the byte stream itself is broken -- wrong magic,
  version or frame kind, bytes where the protocol allows none, a stream that
  ends mid-frame (`eof()`), or the API used out of order.
* `Refused` (an event): a well-framed message this receiver will not accept --
  oversized, unauthenticated, a malformed header, a block out of order, a chain
  hash or payload digest that does not match, an END whose mac does not.

Either way `Receiver.refuse(reason, message)` gives the reply to send before
closing (a `Refused` event carries it already in `.reply`).

The receiver's payload path is zero-copy. `Receiver.accept(first_missing,
payload_target=fn)` registers `fn(header) -> memoryview | None`; when a BLOCK
header parses, the receiver asks `fn` for the block's destination (the engine's
pool: `txn.buffer(i)`) and lands the payload there. A socket wrapper reads
exactly what the parser wants and receives payloads in place::

    while not rx.done:
        view = rx.payload_view()
        if view is not None:                      # inside a payload: straight into the pool
            n = sock.recv_into(view)
            events = rx.payload_filled(n) if n else rx.eof()
        else:                                     # a frame header: small reads, never past it
            data = sock.recv(rx.want())
            events = rx.feed(data) if data else rx.eof()

Without a target (or when it returns None) each payload lands in a fresh
buffer of block_bytes that then belongs to the caller (`BlockReceived.data`):
simple, and one copy more than the pool path. The sender's payload path is zero-copy too: `Sender.block_header`
returns only the 37 header bytes; the caller sends the payload view itself.

This module is the public face and the one to import from; the code lives behind it, one
concern a module: `header` (the signed `Offer`, `Limits`, session ids), `frames` (layouts,
reason codes, HMACs, encoders, the keyless peeks), `events`, and the two state machines
`receiver` and `sender`.
"""

from __future__ import annotations

from kvmesh.node.kvshare.wire.events import (
    Accepted,
    BlockHeader,
    BlockReceived,
    Completed,
    EndReceived,
    OfferReceived,
    PayloadTarget,
    PeerRefused,
    ReceiverEvent,
    Refused,
    SenderEvent,
    SnapshotReceived,
)
from kvmesh.node.kvshare.wire.frames import (
    BLOCK_HEADER_BYTES,
    DIGEST_BYTES,
    MAC_BYTES,
    MAGIC,
    MAX_MESSAGE_BYTES,
    MAX_REASON_BYTES,
    SNAPSHOT_HEADER_BYTES,
    VERSION,
    Kind,
    OfferFrame,
    ProtocolError,
    Reason,
    encode_answer,
    encode_block_header,
    encode_end,
    encode_offer,
    encode_result,
    encode_snapshot_header,
    peek_answer,
    peek_offer,
)
from kvmesh.node.kvshare.wire.header import InvalidSessionId, Limits, Offer, check_session_id
from kvmesh.node.kvshare.wire.receiver import Receiver
from kvmesh.node.kvshare.wire.sender import Sender

__all__ = [
    # constants and frame layouts
    "BLOCK_HEADER_BYTES",
    "DIGEST_BYTES",
    "MAC_BYTES",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "MAX_REASON_BYTES",
    "SNAPSHOT_HEADER_BYTES",
    "VERSION",
    "Kind",
    "Reason",
    # errors
    "InvalidSessionId",
    "ProtocolError",
    # the signed header and a receiver's limits
    "Limits",
    "Offer",
    "check_session_id",
    # encoders and keyless peeks
    "OfferFrame",
    "encode_answer",
    "encode_block_header",
    "encode_end",
    "encode_offer",
    "encode_result",
    "encode_snapshot_header",
    "peek_answer",
    "peek_offer",
    # events
    "Accepted",
    "BlockHeader",
    "BlockReceived",
    "Completed",
    "EndReceived",
    "OfferReceived",
    "PayloadTarget",
    "PeerRefused",
    "ReceiverEvent",
    "Refused",
    "SenderEvent",
    "SnapshotReceived",
    # the two state machines
    "Receiver",
    "Sender",
]
