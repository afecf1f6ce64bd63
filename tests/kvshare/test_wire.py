"""kv_share wire protocol: round trips, authentication, verification, limits, fuzzing."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvmesh.node.engine.hashing import payload_digest
from kvmesh.node.kvshare.wire import (
    MAC_BYTES,
    MAGIC,
    VERSION,
    Accepted,
    BlockHeader,
    BlockReceived,
    Completed,
    EndReceived,
    Kind,
    Limits,
    Offer,
    OfferReceived,
    PeerRefused,
    ProtocolError,
    Receiver,
    Refused,
    Sender,
    encode_answer,
    encode_block_header,
    encode_end,
)
from kvmesh.node.kvshare.wire.frames import _mac

from .helpers import Replica, make_replica

SECRET = b"current-mesh-secret"
OLD_SECRET = b"previous-mesh-secret"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = Limits(max_header_bytes=1024, max_blocks=64, max_tokens=1024, max_block_bytes=4096)


def offer_for(rep: Replica, session: str = "sess-1", generation: int = 3) -> Offer:
    return Offer(
        session=session, sender="node-a", fingerprint=rep.fingerprint, block_size=rep.block_size,
        block_bytes=rep.block_bytes, n_blocks=rep.n_blocks, generation=generation, sent_at=1700000000.5,
    )  # fmt: skip


def block_stream(tx: Sender, rep: Replica, first: int) -> bytes:
    return b"".join(tx.block_header(i, rep.payloads[i]) + rep.payloads[i] for i in range(first, rep.n_blocks)) + tx.end()


def split(blob: bytes, sizes: list[int]) -> list[bytes]:
    out, pos = [], 0
    for n in sizes:
        if pos >= len(blob):
            break
        out.append(blob[pos : pos + n])
        pos += n
    if pos < len(blob):
        out.append(blob[pos:])
    return out


def feed_all(party: Receiver | Sender, chunks: list[bytes]) -> list[object]:
    events: list[object] = []
    for c in chunks:
        events += party.feed(c)
    return events


def handshake(rep: Replica, first: int = 0, *, rx: Receiver | None = None, tx: Sender | None = None) -> tuple[Sender, Receiver]:
    tx = tx or Sender(SECRET)
    rx = rx or Receiver(SECRET)
    [ev] = rx.feed(tx.offer_bytes(offer_for(rep), rep.tokens, rep.hashes))
    assert isinstance(ev, OfferReceived)
    assert tx.feed(rx.accept(first)) == [Accepted(first)]
    return tx, rx


# ---- round trips ---------------------------------------------------------------------


@given(n_blocks=st.integers(0, 4), data=st.data())
@settings(max_examples=60, deadline=None)
def test_round_trip_in_random_fragments(n_blocks: int, data: st.DataObject) -> None:
    """Every frame in both directions, fed in random fragments, decodes to the events that were encoded."""
    rep = make_replica(n_blocks, block_bytes=64, seed=n_blocks)
    first = data.draw(st.integers(0, n_blocks))
    sizes = st.lists(st.integers(1, 150), max_size=60)
    tx, rx = Sender(SECRET), Receiver(SECRET)
    offer = offer_for(rep)

    [ev] = feed_all(rx, split(tx.offer_bytes(offer, rep.tokens, rep.hashes), data.draw(sizes)))
    assert isinstance(ev, OfferReceived)
    assert ev.offer == offer and ev.hashes == rep.hashes
    assert ev.tokens.dtype == np.int32 and np.array_equal(ev.tokens, rep.tokens)

    assert feed_all(tx, split(rx.accept(first), data.draw(sizes))) == [Accepted(first)]

    events = feed_all(rx, split(block_stream(tx, rep, first), data.draw(sizes)))
    want = list(range(first, n_blocks))
    assert [e.index for e in events if isinstance(e, BlockHeader)] == want
    got = [e for e in events if isinstance(e, BlockReceived)]
    assert [e.index for e in got] == want
    assert [bytes(e.data) for e in got] == rep.payloads[first:]
    assert [e.digest for e in got] == rep.digests[first:]
    assert events[-1] == EndReceived(n_blocks - first)

    assert feed_all(tx, split(rx.result_ok(n_blocks * rep.block_size), data.draw(sizes))) == [Completed(n_blocks * rep.block_size)]
    assert rx.done and tx.done


def test_payloads_land_in_the_callers_buffers() -> None:
    """With a payload target, each payload is written into the buffer the caller supplied for its index."""
    rep = make_replica(3, block_bytes=128)
    pool = [bytearray(128) for _ in range(3)]
    tx, rx = Sender(SECRET), Receiver(SECRET)
    rx.feed(tx.offer_bytes(offer_for(rep), rep.tokens, rep.hashes))
    tx.feed(rx.accept(1, payload_target=lambda h: memoryview(pool[h.index])))
    events = rx.feed(block_stream(tx, rep, 1))
    assert [bytes(p) for p in pool] == [bytes(128), rep.payloads[1], rep.payloads[2]]
    landed = [e for e in events if isinstance(e, BlockReceived)]
    assert all(e.data.obj is pool[e.index] for e in landed)


def test_recv_into_path_over_a_socket() -> None:
    """A socket loop reads headers with recv(want()) and payloads with recv_into(payload_view()): no payload byte passes feed()."""
    rep = make_replica(3, block_bytes=4096)
    tx, rx = Sender(SECRET), Receiver(SECRET)
    rx.feed(tx.offer_bytes(offer_for(rep), rep.tokens, rep.hashes))
    pool = bytearray(3 * 4096)
    answer = rx.accept(0, payload_target=lambda h: memoryview(pool)[h.index * 4096 : (h.index + 1) * 4096])
    tx.feed(answer)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(block_stream(tx, rep, 0))  # ~12 KiB: fits the socket buffer
        a.shutdown(socket.SHUT_WR)
        fed = received_in_place = 0
        events: list[object] = []
        while not any(isinstance(e, EndReceived) for e in events):
            view = rx.payload_view()
            if view is not None:
                n = b.recv_into(view)
                received_in_place += n
                events += rx.payload_filled(n) if n else rx.eof()
            else:
                data = b.recv(rx.want())
                fed += len(data)
                events += rx.feed(data) if data else rx.eof()
        assert rx.eof() == []
    assert bytes(pool) == b"".join(rep.payloads)
    assert received_in_place == 3 * 4096
    assert fed == 4 * (1 + 36)  # three block headers and the END frame


def test_payload_target_returning_none_gets_its_own_buffer() -> None:
    """A payload target may decline (None): that block lands in a fresh buffer instead."""
    rep = make_replica(2, block_bytes=64)
    tx, rx = Sender(SECRET), Receiver(SECRET)
    rx.feed(tx.offer_bytes(offer_for(rep), rep.tokens, rep.hashes))
    tx.feed(rx.accept(0, payload_target=lambda h: None))
    got = [e for e in rx.feed(block_stream(tx, rep, 0)) if isinstance(e, BlockReceived)]
    assert [bytes(e.data) for e in got] == rep.payloads


def test_sender_may_supply_known_digests() -> None:
    """block_header(i, digest=...) skips hashing the payload; the receiver still verifies what lands."""
    rep = make_replica(2, block_bytes=64)
    tx, rx = handshake(rep)
    stream = b"".join(tx.block_header(i, digest=rep.digests[i]) + rep.payloads[i] for i in range(2)) + tx.end()
    assert rx.feed(stream)[-1] == EndReceived(2)


def test_nothing_missing_goes_straight_to_end() -> None:
    """When the receiver already holds every block, the sender sends END with a count of zero."""
    rep = make_replica(2)
    tx, rx = handshake(rep, first=2)
    assert rx.feed(tx.end()) == [EndReceived(0)]


# ---- authentication ----------------------------------------------------------------------


def test_wrong_secret_is_refused_unauthenticated() -> None:
    """An offer signed with another secret is refused 'unauthenticated'; the sender sees an unsigned refusal."""
    rep = make_replica(2)
    tx, rx = Sender(b"some-other-secret"), Receiver(SECRET)
    [ev] = rx.feed(tx.offer_bytes(offer_for(rep), rep.tokens, rep.hashes))
    assert isinstance(ev, Refused) and ev.reason == "unauthenticated"
    assert rx.done
    [peer] = tx.feed(ev.reply)
    assert peer == PeerRefused("answer", "unauthenticated", peer.message, authenticated=False)


def test_previous_secret_is_accepted_during_rotation() -> None:
    """A receiver that rotated accepts offers under the previous secret and signs its replies with it."""
    rep = make_replica(2, block_bytes=64)
    tx, rx = handshake(rep, tx=Sender(OLD_SECRET), rx=Receiver(SECRET, OLD_SECRET))
    assert rx.feed(block_stream(tx, rep, 0))[-1] == EndReceived(2)
    assert tx.feed(rx.result_ok(16)) == [Completed(16)]


def test_previous_secret_alone_is_not_enough_without_rotation() -> None:
    """A receiver without the previous secret configured refuses an offer signed with it."""
    rep = make_replica(1)
    [ev] = Receiver(SECRET).feed(Sender(OLD_SECRET).offer_bytes(offer_for(rep), rep.tokens, rep.hashes))
    assert isinstance(ev, Refused) and ev.reason == "unauthenticated"


def test_tampered_header_byte_is_refused() -> None:
    """A header JSON byte changed in flight fails the offer mac: 'unauthenticated'."""
    rep = make_replica(2)
    frame = bytearray(Sender(SECRET).offer_bytes(offer_for(rep), rep.tokens, rep.hashes))
    at = frame.index(b'"generation":3') + len(b'"generation":')
    frame[at] = ord("9")
    [ev] = Receiver(SECRET).feed(bytes(frame))
    assert isinstance(ev, Refused) and ev.reason == "unauthenticated"


def test_every_single_bit_flip_in_an_offer_is_caught() -> None:
    """Flipping any one bit of an OFFER never yields an accepted offer: a refusal, a ProtocolError, or a truncation."""
    rep = make_replica(2)
    frame = Sender(SECRET).offer_bytes(offer_for(rep), rep.tokens, rep.hashes)
    for pos in range(len(frame)):
        bad = bytearray(frame)
        bad[pos] ^= 0x10
        rx = Receiver(SECRET)
        try:
            events = rx.feed(bytes(bad))
            if not events:
                rx.eof()  # a length grew: the receiver still waits, and the stream ends here
        except ProtocolError:
            continue
        assert len(events) == 1 and isinstance(events[0], Refused), pos
        assert events[0].reason in ("unauthenticated", "oversized"), (pos, events[0])


def test_forged_accept_is_rejected_by_the_sender() -> None:
    """An ANSWER accept not signed with the mesh secret is a ProtocolError for the sender."""
    rep = make_replica(2)
    tx = Sender(SECRET)
    Receiver(SECRET).feed(tx.offer_bytes(offer_for(rep), rep.tokens, rep.hashes))
    with pytest.raises(ProtocolError) as e:
        tx.feed(encode_answer(b"attacker", tx._offer_mac, first_missing=2))
    assert e.value.reason == "unauthenticated"


def test_answer_replayed_from_another_offer_is_rejected() -> None:
    """An accept answer is bound to its offer: replayed against a new offer it does not verify."""
    rep = make_replica(2)
    tx1, rx1 = Sender(SECRET), Receiver(SECRET)
    rx1.feed(tx1.offer_bytes(offer_for(rep, generation=1), rep.tokens, rep.hashes))
    old_answer = rx1.accept(0)
    tx2 = Sender(SECRET)
    tx2.offer_bytes(offer_for(rep, generation=2), rep.tokens, rep.hashes)
    with pytest.raises(ProtocolError) as e:
        tx2.feed(old_answer)
    assert e.value.reason == "unauthenticated"


def test_receiver_refusal_after_authentication_is_signed() -> None:
    """A refusal decided by the application (e.g. busy) reaches the sender signed, with its reason and message."""
    rep = make_replica(2)
    tx, rx = Sender(SECRET), Receiver(SECRET)
    rx.feed(tx.offer_bytes(offer_for(rep), rep.tokens, rep.hashes))
    assert tx.feed(rx.refuse("busy", "no free slot")) == [PeerRefused("answer", "busy", "no free slot", authenticated=True)]
    assert rx.refuse("busy", "again") == b""


# ---- block verification -------------------------------------------------------------------


def test_flipped_payload_bit_refuses_the_block() -> None:
    """One flipped payload bit fails that block's digest: refused 'digest', reported to the sender in a RESULT."""
    rep = make_replica(3, block_bytes=64)
    tx, rx = handshake(rep)
    stream = bytearray(block_stream(tx, rep, 0))
    stream[(37 + 64) + 37 + 10] ^= 0x01  # block 1, payload byte 10
    events = rx.feed(bytes(stream))
    assert [type(e) for e in events] == [BlockHeader, BlockReceived, BlockHeader, Refused]
    assert events[-1].reason == "digest"
    assert tx.feed(events[-1].reply) == [PeerRefused("result", "digest", events[-1].message, authenticated=True)]


def test_payload_and_digest_replaced_together_fail_the_end_mac() -> None:
    """A block whose payload and digest were both swapped in flight passes its digest, but END's mac refuses it."""
    rep = make_replica(2, block_bytes=64)
    tx, rx = handshake(rep)
    evil = bytes(64)
    honest = block_stream(tx, rep, 0)
    forged = encode_block_header(0, rep.hashes[0], payload_digest(evil)) + evil + honest[37 + 64 :]
    events = rx.feed(forged)
    assert isinstance(events[-1], Refused) and events[-1].reason == "unauthenticated"
    assert not any(isinstance(e, EndReceived) for e in events)


def test_end_mac_mismatch_is_refused() -> None:
    """An END whose mac was altered is refused 'unauthenticated'."""
    rep = make_replica(1, block_bytes=64)
    tx, rx = handshake(rep)
    stream = bytearray(block_stream(tx, rep, 0))
    stream[-1] ^= 0x80
    assert rx.feed(bytes(stream))[-1].reason == "unauthenticated"


def test_block_with_another_chain_hash_is_refused() -> None:
    """A block header whose chain hash is not the offer's hash at that index is refused 'chain' before its payload."""
    rep = make_replica(2, block_bytes=64)
    _, rx = handshake(rep)
    [ev] = rx.feed(encode_block_header(0, rep.hashes[1], rep.digests[0]) + rep.payloads[0])
    assert isinstance(ev, Refused) and ev.reason == "chain"


def test_block_out_of_order_is_refused() -> None:
    """A block other than the next expected one is refused 'order'."""
    rep = make_replica(3, block_bytes=64)
    _, rx = handshake(rep, first=1)
    [ev] = rx.feed(encode_block_header(2, rep.hashes[2], rep.digests[2]))
    assert isinstance(ev, Refused) and ev.reason == "order"


def test_end_before_every_block_is_refused() -> None:
    """END while blocks are still owed is refused 'incomplete'."""
    rep = make_replica(2, block_bytes=64)
    tx, rx = handshake(rep)
    first = tx.block_header(0, rep.payloads[0]) + rep.payloads[0]
    events = rx.feed(first + encode_end(1, tx._end_mac.digest()))
    assert events[-1].reason == "incomplete"


# ---- framing errors and limits ----------------------------------------------------------------


def signed_offer_frame(header: bytes, tokens: np.ndarray, hashes: list[bytes], secret: bytes = SECRET) -> bytes:
    body = struct.pack("<4sBBIII", MAGIC, VERSION, Kind.OFFER, len(header), len(tokens), len(hashes))
    body += header + tokens.astype("<i4").tobytes() + b"".join(hashes)
    return body + _mac(secret, body)


def test_bad_magic_fails_at_the_first_byte() -> None:
    """A stream that does not start with KVSH is a ProtocolError as soon as the first wrong byte arrives."""
    with pytest.raises(ProtocolError) as e:
        Receiver(SECRET).feed(b"G")
    assert e.value.reason == "malformed"


def test_other_version_is_a_protocol_error() -> None:
    """An offer of another protocol version (the one before snapshot frames) is a ProtocolError with reason 'version'."""
    with pytest.raises(ProtocolError) as e:
        Receiver(SECRET).feed(struct.pack("<4sBBIII", MAGIC, 1, Kind.OFFER, 10, 0, 0))  # version 1: blocks alone
    assert e.value.reason == "version"


@pytest.mark.parametrize("lengths", [(1 << 31, 0, 0), (10, 1 << 30, 0), (10, 0, 1 << 30), (2**32 - 1, 2**32 - 1, 2**32 - 1)])
def test_oversized_offer_is_refused_from_its_prefix(lengths: tuple[int, int, int]) -> None:
    """Lengths beyond the limits are refused 'oversized' from the 18-byte prefix alone, nothing more buffered."""
    rx = Receiver(SECRET, limits=SMALL)
    [ev] = rx.feed(struct.pack("<4sBBIII", MAGIC, VERSION, Kind.OFFER, *lengths) + b"x" * 1000)
    assert isinstance(ev, Refused) and ev.reason == "oversized"
    assert rx.done and rx.want() == 0


def test_block_bytes_over_the_limit_is_refused() -> None:
    """An authenticated offer whose blocks exceed max_block_bytes is refused 'oversized' (no buffer is made)."""
    rep = make_replica(1, block_bytes=8192)
    [ev] = Receiver(SECRET, limits=SMALL).feed(Sender(SECRET).offer_bytes(offer_for(rep), rep.tokens, rep.hashes))
    assert isinstance(ev, Refused) and ev.reason == "oversized"


def header_json(**changes: object) -> bytes:
    doc = {"session": "s", "sender": "a", "fingerprint": "f", "block_size": 8, "block_bytes": 64, "n_blocks": 0,
           "generation": 0, "sent_at": 0.0}  # fmt: skip
    return json.dumps({**doc, **changes}).encode()


@pytest.mark.parametrize(
    "header",
    [b"{not json", b"[]", header_json(session=""), header_json(session="a\x00b"), header_json(block_size="8"),
     header_json(n_blocks=5), header_json(extra=1)],
    ids=["not-json", "not-object", "empty-session", "control-session", "string-int", "count-mismatch", "extra-field"],
)
def test_malformed_but_signed_header_is_refused(header: bytes) -> None:
    """A signed offer whose header is not a valid Offer (or disagrees with the frame) is refused 'malformed'."""
    [ev] = Receiver(SECRET).feed(signed_offer_frame(header, np.zeros(0, np.int32), []))
    assert isinstance(ev, Refused) and ev.reason == "malformed"


@pytest.mark.parametrize("session", ["a\x00b", "x" * 257, "", "a\rb"])
def test_offer_model_refuses_non_session_ids(session: str) -> None:
    """The Offer model itself refuses empty, over-long (257 bytes) and control-character session ids."""
    with pytest.raises(ValidationError):
        Offer(session=session, sender="a", fingerprint="f", block_size=8, block_bytes=64, n_blocks=0, generation=0, sent_at=0.0)


@pytest.mark.parametrize("session", ["../x", "a/b", "proj/feature-x", "b64:ab+/cd==", "user+tag@example.com",
                                     "s\u00e9ssion", "z" * 256])
def test_offer_carries_any_printable_session_id_verbatim(session: str) -> None:
    """A path-like, base64, email or UTF-8 id crosses the wire as itself: the receiver's offer names the same id."""
    rep = make_replica(1)
    [ev] = Receiver(SECRET).feed(Sender(SECRET).offer_bytes(offer_for(rep, session=session),
                                                              rep.tokens, rep.hashes))
    assert isinstance(ev, OfferReceived) and ev.offer.session == session


def test_bytes_before_the_answer_are_unexpected() -> None:
    """The sender must wait for the ANSWER: bytes right after the offer are a ProtocolError."""
    rep = make_replica(1)
    with pytest.raises(ProtocolError) as e:
        Receiver(SECRET).feed(Sender(SECRET).offer_bytes(offer_for(rep), rep.tokens, rep.hashes) + b"\x03")
    assert e.value.reason == "unexpected"


def test_eof_mid_block_is_truncated_and_after_end_is_fine() -> None:
    """eof() inside a frame raises ProtocolError('truncated'); after END it is the sender's normal half-close."""
    rep = make_replica(2, block_bytes=64)
    tx, rx = handshake(rep)
    stream = block_stream(tx, rep, 0)
    rx.feed(stream[:50])
    with pytest.raises(ProtocolError) as e:
        rx.eof()
    assert e.value.reason == "truncated"
    tx2, rx2 = handshake(rep)
    rx2.feed(block_stream(tx2, rep, 0))
    assert rx2.eof() == []


def test_refusal_mid_stream_discards_what_follows() -> None:
    """After a refusal the receiver is done: later bytes (still in flight) are ignored."""
    rep = make_replica(2, block_bytes=64)
    _, rx = handshake(rep)
    rx.feed(encode_block_header(1, rep.hashes[1], rep.digests[1]))
    assert rx.done and rx.feed(b"anything at all") == []


def test_api_out_of_order_is_a_protocol_error() -> None:
    """accept() before an offer, or a block header before an answer, is a ProtocolError('state')."""
    with pytest.raises(ProtocolError) as e:
        Receiver(SECRET).accept(0)
    assert e.value.reason == "state"
    tx = Sender(SECRET)
    with pytest.raises(ProtocolError):
        tx.block_header(0, b"x")


# ---- fuzzing ----------------------------------------------------------------------------------


def assert_only_protocol_errors(feed: object, chunks: list[bytes]) -> list[object]:
    events: list[object] = []
    try:
        for c in chunks:
            events += feed(c)  # type: ignore[operator]
    except ProtocolError as e:
        assert e.reason and str(e)
    return events


@given(st.binary(max_size=3000), st.lists(st.integers(1, 400), max_size=20))
@FUZZ
def test_fuzz_random_bytes_into_a_receiver(blob: bytes, sizes: list[int]) -> None:
    """Random bytes, with or without a valid preamble, raise nothing but ProtocolError."""
    for data in (blob, MAGIC + bytes([VERSION, Kind.OFFER]) + blob):
        rx = Receiver(SECRET, limits=SMALL)
        assert_only_protocol_errors(rx.feed, split(data, sizes))
        with contextlib.suppress(ProtocolError):
            rx.eof()


@given(
    st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.binary(max_size=4000)
)
@FUZZ
def test_fuzz_claimed_lengths_never_allocate_beyond_limits(header_len: int, n_tokens: int, n_hashes: int, tail: bytes) -> None:
    """Whatever lengths a prefix claims, the receiver refuses or buffers within its limits (traced allocations)."""
    data = struct.pack("<4sBBIII", MAGIC, VERSION, Kind.OFFER, header_len, n_tokens, n_hashes) + tail
    rx = Receiver(SECRET, limits=SMALL)
    tracemalloc.start()
    try:
        events = assert_only_protocol_errors(rx.feed, [data[i : i + 512] for i in range(0, len(data), 512)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    most = SMALL.max_header_bytes + 4 * SMALL.max_tokens + 16 * SMALL.max_blocks + MAC_BYTES
    assert peak < 4 * most + 64 * 1024
    over = header_len > SMALL.max_header_bytes or n_tokens > SMALL.max_tokens or n_hashes > SMALL.max_blocks
    if over:
        assert [type(e) for e in events] == [Refused] and events[0].reason == "oversized"


@given(n_blocks=st.integers(1, 3), cut=st.integers(0, 10_000), data=st.data())
@FUZZ
def test_fuzz_truncated_valid_streams(n_blocks: int, cut: int, data: st.DataObject) -> None:
    """A valid transfer cut anywhere and fed in random fragments ends in ProtocolError('truncated'), nothing else."""
    rep = make_replica(n_blocks, block_bytes=64, seed=cut)
    tx, rx = Sender(SECRET), Receiver(SECRET)
    offer = tx.offer_bytes(offer_for(rep), rep.tokens, rep.hashes)
    sizes = data.draw(st.lists(st.integers(1, 120), max_size=30))
    cut %= len(offer) + n_blocks * (37 + 64) + 37
    events = feed_all(rx, split(offer[:cut], sizes))
    if cut >= len(offer):
        assert isinstance(events[0], OfferReceived)
        tx.feed(rx.accept(0))
        feed_all(rx, split(block_stream(tx, rep, 0)[: cut - len(offer)], sizes))
    with pytest.raises(ProtocolError) as e:
        rx.eof()
    assert e.value.reason == "truncated"


@given(n_blocks=st.integers(1, 3), pos=st.integers(0, 10_000), bit=st.integers(0, 7), data=st.data())
@FUZZ
def test_fuzz_any_bit_flip_in_the_block_stream_is_caught(n_blocks: int, pos: int, bit: int, data: st.DataObject) -> None:
    """A bit flipped anywhere in BLOCK or END frames never yields EndReceived: refusal or ProtocolError only."""
    rep = make_replica(n_blocks, block_bytes=64, seed=pos)
    tx, rx = handshake(rep)
    stream = bytearray(block_stream(tx, rep, 0))
    stream[pos % len(stream)] ^= 1 << bit
    events = assert_only_protocol_errors(rx.feed, split(bytes(stream), data.draw(st.lists(st.integers(1, 90), max_size=20))))
    assert not any(isinstance(e, EndReceived) for e in events)


@given(st.binary(max_size=2000), st.lists(st.integers(1, 200), max_size=12))
@FUZZ
def test_fuzz_random_bytes_after_the_answer(blob: bytes, sizes: list[int]) -> None:
    """Random bytes where BLOCK/END frames belong raise nothing but ProtocolError."""
    rep = make_replica(2, block_bytes=64)
    _, rx = handshake(rep, rx=Receiver(SECRET, limits=SMALL))
    assert_only_protocol_errors(rx.feed, split(bytes([Kind.BLOCK]) + blob, sizes))


@given(st.binary(max_size=2000), st.lists(st.integers(1, 200), max_size=12), st.booleans())
@FUZZ
def test_fuzz_random_replies_into_a_sender(blob: bytes, sizes: list[int], with_magic: bool) -> None:
    """Random bytes as the receiver's reply raise nothing but ProtocolError in the sender."""
    rep = make_replica(2)
    tx = Sender(SECRET)
    tx.offer_bytes(offer_for(rep), rep.tokens, rep.hashes)
    data = (MAGIC + bytes([VERSION, Kind.ANSWER]) + blob) if with_magic else blob
    assert_only_protocol_errors(tx.feed, split(data, sizes))
    with contextlib.suppress(ProtocolError):
        tx.eof()
