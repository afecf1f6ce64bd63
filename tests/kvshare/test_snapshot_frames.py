"""kv_share's SNAPSHOT frame (wire v2): a state snapshot after the blocks, announced in the signed offer, verified by
its digest and the END mac like the blocks; malformed, unannounced, misplaced or corrupt ones are refused, saying why."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvmesh.node.engine.hashing import payload_digest
from kvmesh.node.kvshare.wire import (
    EndReceived,
    Kind,
    Limits,
    Offer,
    ProtocolError,
    Receiver,
    Refused,
    Sender,
    SnapshotReceived,
    encode_snapshot_header,
)

from .helpers import Replica, make_replica

SECRET = b"current-mesh-secret"
BS = 8


def _offer(rep: Replica, pos: int, size: int) -> Offer:
    return Offer(session="snap-1", sender="a", fingerprint=rep.fingerprint, block_size=rep.block_size,
                 block_bytes=rep.block_bytes, n_blocks=rep.n_blocks, generation=1, sent_at=0.0, snapshot_pos=pos,
                 snapshot_bytes=size)


def _handshake(rep: Replica, pos: int, blob: np.ndarray, *, limits: Limits | None = None) -> tuple[Sender, Receiver, list]:
    tx, rx = Sender(SECRET), Receiver(SECRET, limits=limits)
    events = rx.feed(tx.offer_bytes(_offer(rep, pos, blob.nbytes), rep.tokens, rep.hashes))
    if events and isinstance(events[0], Refused):
        return tx, rx, events
    tx.feed(rx.accept(0))
    return tx, rx, events


def _blocks(tx: Sender, rep: Replica) -> bytes:
    return b"".join(tx.block_header(i, p) + p for i, p in enumerate(rep.payloads))


def _blob(n: int = 300, seed: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_a_snapshot_after_the_blocks_round_trips_before_end() -> None:
    """The receiver gets every block, then the snapshot at the announced position with the sender's bytes, then END."""
    rep, blob = make_replica(3, block_size=BS), _blob()
    tx, rx, _ = _handshake(rep, 2 * BS, blob)
    events = rx.feed(_blocks(tx, rep) + tx.snapshot_header(blob) + blob.tobytes() + tx.end())
    snaps = [e for e in events if isinstance(e, SnapshotReceived)]
    assert len(snaps) == 1 and snaps[0].pos == 2 * BS and bytes(snaps[0].data) == blob.tobytes()
    assert isinstance(events[-1], EndReceived) and events[-1].count == 3
    assert rx.offer is not None and (rx.offer.snapshot_pos, rx.offer.snapshot_bytes) == (2 * BS, blob.nbytes)


def test_a_flipped_bit_in_the_snapshot_payload_is_refused_as_a_digest_mismatch() -> None:
    """The snapshot's payload is checked against its digest as a block's is: one flipped bit refuses the transfer."""
    rep, blob = make_replica(2, block_size=BS), _blob()
    tx, rx, _ = _handshake(rep, 2 * BS, blob)
    bad = bytearray(blob.tobytes())
    bad[len(bad) // 2] ^= 0x04
    events = rx.feed(_blocks(tx, rep) + tx.snapshot_header(blob) + bytes(bad))
    assert isinstance(events[-1], Refused) and events[-1].reason == "digest" and "snapshot" in events[-1].message
    assert not any(isinstance(e, (SnapshotReceived, EndReceived)) for e in events)


def test_the_end_mac_covers_the_snapshot() -> None:
    """A snapshot swapped in flight with a digest of its own (no key needed for that) fails the END mac."""
    rep, blob = make_replica(2, block_size=BS), _blob()
    tx, rx, _ = _handshake(rep, 2 * BS, blob)
    other = _blob(seed=9)
    swapped = encode_snapshot_header(2 * BS, other.nbytes, payload_digest(other)) + other.tobytes()
    blocks = _blocks(tx, rep)
    tx.snapshot_header(blob)  # the sender's own account of what it sent: its END mac covers `blob`
    events = rx.feed(blocks + swapped + tx.end())
    assert isinstance(events[-1], Refused) and events[-1].reason == "unauthenticated"


@pytest.mark.parametrize("case", ["unannounced", "before the last block", "other size", "other position", "missing"])
def test_a_misplaced_or_malformed_snapshot_frame_is_refused_saying_why(case: str) -> None:
    """A snapshot the offer did not announce, one before the last block, one of another size or position than
    announced, or an END without the announced one: each refused with its reason, never an EndReceived."""
    rep, blob = make_replica(2, block_size=BS), _blob()
    tx, rx, _ = _handshake(rep, 0 if case == "unannounced" else 2 * BS, blob if case != "unannounced" else blob[:0])
    d = payload_digest(blob)
    frame = {"unannounced": encode_snapshot_header(2 * BS, blob.nbytes, d),
             "before the last block": b"",
             "other size": encode_snapshot_header(2 * BS, blob.nbytes + 1, d),
             "other position": encode_snapshot_header(BS, blob.nbytes, d),
             "missing": b""}[case]
    if case == "before the last block":
        p = rep.payloads[0]
        stream = tx.block_header(0, p) + p + encode_snapshot_header(2 * BS, blob.nbytes, d)
    elif case == "missing":
        stream = _blocks(tx, rep) + struct.pack("<BI32s", Kind.END, 2, bytes(32))
    else:
        stream = _blocks(tx, rep) + frame
    events = rx.feed(stream)
    want = {"unannounced": "order", "before the last block": "order", "other size": "malformed",
            "other position": "malformed", "missing": "incomplete"}[case]
    assert isinstance(events[-1], Refused) and events[-1].reason == want, events[-1]
    assert not any(isinstance(e, EndReceived) for e in events)


@pytest.mark.parametrize(("pos", "size", "reason"), [(5, 10, "malformed"), (3 * BS, 10, "malformed"), (BS, 0, "malformed"),
                                                    (BS, 1 << 20, "oversized")])
def test_an_offer_announcing_an_impossible_snapshot_is_refused_from_its_header(pos: int, size: int, reason: str) -> None:
    """A snapshot off a block boundary, past the offered tokens, without bytes, or over the limit: refused at the offer."""
    rep = make_replica(2, block_size=BS)
    tx, rx = Sender(SECRET), Receiver(SECRET, limits=Limits(max_snapshot_bytes=1 << 16))
    [ev] = rx.feed(tx.offer_bytes(_offer(rep, pos, size), rep.tokens, rep.hashes))
    assert isinstance(ev, Refused) and ev.reason == reason


def test_the_sender_will_not_end_without_the_announced_snapshot_nor_send_it_early() -> None:
    """The sender's state machine keeps the order: blocks, the snapshot once, then END."""
    rep, blob = make_replica(2, block_size=BS), _blob()
    tx, _, _ = _handshake(rep, 2 * BS, blob)
    with pytest.raises(ProtocolError):
        tx.snapshot_header(blob)  # before the last block
    _blocks(tx, rep)
    with pytest.raises(ProtocolError):
        tx.end()
    with pytest.raises(ValueError):
        tx.snapshot_header(blob[:-1])  # not the announced size
    tx.snapshot_header(blob)
    with pytest.raises(ProtocolError):
        tx.snapshot_header(blob)
    assert tx.end()
