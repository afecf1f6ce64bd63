"""kv_share's receiver state machine: decodes OFFER, BLOCKs and END; encodes the replies.

Sans-I/O like the rest of the wire modules: the caller feeds bytes (or fills `payload_view()`
in place) and gets `ReceiverEvent`s back. Public through `kvmesh.node.kvshare.wire`.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from typing import Any

import numpy as np
from pydantic import ValidationError

from kvmesh.node.engine.hashing import HASH_BYTES, TOKEN_DTYPE, payload_digest
from kvmesh.node.kvshare.wire.events import (
    BlockHeader,
    BlockReceived,
    EndReceived,
    OfferReceived,
    PayloadTarget,
    ReceiverEvent,
    Refused,
    SnapshotReceived,
)
from kvmesh.node.kvshare.wire.frames import (
    _BLOCK_REST,
    _END_REST,
    _OFFER_PREFIX,
    _SNAP_REST,
    MAC_BYTES,
    MAGIC,
    VERSION,
    Kind,
    ProtocolError,
    Reason,
    _as_bytes_view,
    _keys,
    _mac,
    encode_answer,
    encode_result,
)
from kvmesh.node.kvshare.wire.header import Limits, Offer

# ---- receiver --------------------------------------------------------------------------


def _snapshot_problem(offer: Offer, limits: Limits) -> tuple[str, str] | None:
    """Why the snapshot the offer announces cannot be taken (None: none announced, or a sound one)."""
    pos, size = offer.snapshot_pos, offer.snapshot_bytes
    if (pos == 0) != (size == 0) or pos > offer.num_tokens or pos % offer.block_size:
        return Reason.MALFORMED, f"a snapshot of {size} bytes at {pos} is not at a block boundary of the offered tokens"
    if size > limits.max_snapshot_bytes:
        return Reason.OVERSIZED, f"a {size}-byte snapshot exceeds the limit {limits.max_snapshot_bytes}"
    return None


class _Rx(enum.Enum):
    PREFIX = "offer prefix"
    BODY = "offer body"
    DECIDE = "awaiting accept() or refuse()"
    KIND = "frame kind"
    BLOCK = "block header"
    PAYLOAD = "block payload"
    SNAP = "snapshot header"
    END = "end frame"
    RESULT = "awaiting result_ok() or refuse()"
    FAILED = "failed"
    DONE = "done"


class Receiver:
    """Receiver side of one transfer: decodes OFFER, BLOCKs and END; encodes the replies."""

    def __init__(self, secret: bytes, previous_secret: bytes | None = None, *, limits: Limits | None = None) -> None:
        self._keys = _keys(secret, previous_secret)
        self.limits = limits or Limits()
        self._state = _Rx.PREFIX
        self._need = _OFFER_PREFIX.size
        self._acc = bytearray()
        self._prefix = b""
        self._lens = (0, 0, 0)  # header bytes, tokens, hashes, from the prefix
        self.offer: Offer | None = None
        self.hashes: list[bytes] = []
        self.first_missing: int | None = None
        self._key: bytes | None = None
        self._offer_mac = b""
        self._answered = False
        self._replied = False
        self._next = 0
        self._end_mac: Any = None  # running hmac over the streamed digests
        self._provider: PayloadTarget | None = None
        self._header: BlockHeader | None = None
        self._target: memoryview | None = None
        self._filled = 0
        self._snap: tuple[int, bytes] | None = None  # (position, digest) while the payload is the snapshot's
        self._snap_done = False

    # -- state the caller may look at

    @property
    def done(self) -> bool:
        """Nothing more will be read: refused, failed, or the result was sent."""
        return self._state in (_Rx.DONE, _Rx.FAILED)

    @property
    def state(self) -> str:
        return self._state.value

    def want(self) -> int:
        """Bytes needed to finish the current frame part (0 while awaiting the caller)."""
        if self._state is _Rx.PAYLOAD:
            return len(self._target or b"") - self._filled
        if self._state in (_Rx.PREFIX, _Rx.BODY, _Rx.KIND, _Rx.BLOCK, _Rx.SNAP, _Rx.END):
            return self._need - len(self._acc)
        return 0

    def payload_view(self) -> memoryview | None:
        """The unfilled tail of the current block's destination, for `sock.recv_into`."""
        if self._state is not _Rx.PAYLOAD or self._target is None:
            return None
        return self._target[self._filled :]

    # -- input

    def feed(self, data: bytes | bytearray | memoryview) -> list[ReceiverEvent]:
        """Consume bytes from the sender; return the events they complete."""
        if self._state is _Rx.FAILED:
            raise ProtocolError(Reason.STATE, "this transfer already failed; refuse() and close")
        view = _as_bytes_view(data)
        events: list[ReceiverEvent] = []
        try:
            while len(view) and self._state is not _Rx.DONE:
                if self._state in (_Rx.DECIDE, _Rx.RESULT):
                    raise ProtocolError(Reason.UNEXPECTED, f"{len(view)} bytes arrived while {self._state.value}")
                if self._state is _Rx.PAYLOAD:
                    view = self._fill_payload(view, events)
                    continue
                take = min(self._need - len(self._acc), len(view))
                self._acc += view[:take]
                view = view[take:]
                if self._state is _Rx.PREFIX:
                    self._check_magic()
                if len(self._acc) == self._need:
                    unit, self._acc = self._acc, bytearray()
                    events += self._on_unit(unit)
        except ProtocolError:
            self._state = _Rx.FAILED
            raise
        return events

    def payload_filled(self, n: int) -> list[ReceiverEvent]:
        """`n` bytes were written into `payload_view()` (by `recv_into`)."""
        view = self.payload_view()
        if view is None or not 0 <= n <= len(view):
            self._state = _Rx.FAILED
            raise ProtocolError(Reason.STATE, f"payload_filled({n}) with {0 if view is None else len(view)} bytes of payload wanted")
        self._filled += n
        return self._payload_done() if self._filled == len(self._target or b"") else []

    def eof(self) -> list[ReceiverEvent]:
        """The sender closed its side. Fine after END; anywhere else the stream was truncated."""
        if self._state in (_Rx.RESULT, _Rx.DONE, _Rx.FAILED):
            return []
        where = self._state.value
        self._state = _Rx.FAILED
        raise ProtocolError(Reason.TRUNCATED, f"the sender's stream ended inside the {where}")

    # -- the caller's decisions

    def accept(self, first_missing: int, *, payload_target: PayloadTarget | None = None) -> bytes:
        """ANSWER: stream blocks from `first_missing`. `payload_target(header)` returns each block's destination."""
        if self._state is not _Rx.DECIDE or self.offer is None:
            raise ProtocolError(Reason.STATE, f"accept() while {self._state.value}")
        if not 0 <= first_missing <= self.offer.n_blocks:
            raise ProtocolError(Reason.STATE, f"first_missing {first_missing} is outside 0..{self.offer.n_blocks}")
        self.first_missing = self._next = first_missing
        self._provider = payload_target
        self._end_mac = hmac.new(self._key or b"", self._offer_mac, hashlib.sha256)
        self._answered = True
        self._to_frames()
        return encode_answer(self._key, self._offer_mac, first_missing=first_missing)

    def result_ok(self, tokens: int) -> bytes:
        """RESULT ok: the replica is in, `tokens` of the session are resident."""
        if self._state is not _Rx.RESULT:
            raise ProtocolError(Reason.STATE, f"result_ok() while {self._state.value}")
        self._state, self._replied = _Rx.DONE, True
        return encode_result(self._key, self._offer_mac, tokens=tokens)

    def refuse(self, reason: str, message: str) -> bytes:
        """The refusal to send back, as an ANSWER before `accept()` or a RESULT after; b'' once replied."""
        if self._replied:
            return b""
        self._state, self._replied = _Rx.DONE, True
        if not self._answered:
            return encode_answer(self._key, self._offer_mac, reason=reason, message=message)
        return encode_result(self._key, self._offer_mac, reason=reason, message=message)

    # -- parsing

    def _refused(self, reason: str, message: str) -> list[ReceiverEvent]:
        return [Refused(str(reason), message, self.refuse(reason, message))]

    def _check_magic(self) -> None:
        n = min(len(self._acc), len(MAGIC))
        if self._acc[:n] != MAGIC[:n]:
            raise ProtocolError(Reason.MALFORMED, "not a kv_share stream (bad magic)")

    def _on_unit(self, unit: bytearray) -> list[ReceiverEvent]:
        handler = {
            _Rx.PREFIX: self._on_prefix,
            _Rx.BODY: self._on_body,
            _Rx.KIND: self._on_kind,
            _Rx.BLOCK: self._on_block,
            _Rx.SNAP: self._on_snapshot,
            _Rx.END: self._on_end,
        }[self._state]
        return handler(unit)

    def _on_prefix(self, unit: bytearray) -> list[ReceiverEvent]:
        _, version, kind, header_len, n_tokens, n_hashes = _OFFER_PREFIX.unpack(unit)
        if version != VERSION:
            raise ProtocolError(Reason.VERSION, f"kv_share version {version}; this node speaks {VERSION}")
        if kind != Kind.OFFER:
            raise ProtocolError(Reason.UNEXPECTED, f"expected an OFFER, got frame kind {kind}")
        lim = self.limits
        for what, got, most in (
            ("header", header_len, lim.max_header_bytes),
            ("token count", n_tokens, lim.max_tokens),
            ("block count", n_hashes, lim.max_blocks),
        ):
            if got > most:
                return self._refused(Reason.OVERSIZED, f"offer {what} {got} exceeds the limit {most}")
        self._prefix = bytes(unit)
        self._lens = (header_len, n_tokens, n_hashes)
        self._state, self._need = _Rx.BODY, header_len + 4 * n_tokens + HASH_BYTES * n_hashes + MAC_BYTES
        return []

    def _authenticate(self, signed: memoryview, mac: memoryview) -> bytes | None:
        for key in self._keys:
            if hmac.compare_digest(_mac(key, self._prefix, signed), mac):
                return key
        return None

    def _on_body(self, unit: bytearray) -> list[ReceiverEvent]:
        header_len, n_tokens, n_hashes = self._lens
        body = memoryview(unit)
        key = self._authenticate(body[:-MAC_BYTES], body[-MAC_BYTES:])
        if key is None:
            return self._refused(Reason.UNAUTHENTICATED, "the offer's mac matches neither the current nor the previous mesh secret")
        self._key, self._offer_mac = key, bytes(body[-MAC_BYTES:])
        try:
            offer = Offer.model_validate_json(bytes(body[:header_len]))
        except ValidationError as e:
            return self._refused(Reason.MALFORMED, f"bad offer header: {e.error_count()} error(s), first: {e.errors()[0]['msg']}")
        if offer.n_blocks != n_hashes or offer.num_tokens != n_tokens:
            said = f"offer says {offer.n_blocks} blocks of {offer.block_size}"
            return self._refused(Reason.MALFORMED, f"{said}; the frame has {n_hashes} hashes, {n_tokens} tokens")
        if offer.block_bytes > self.limits.max_block_bytes:
            return self._refused(Reason.OVERSIZED, f"block_bytes {offer.block_bytes} exceeds the limit {self.limits.max_block_bytes}")
        if (why := _snapshot_problem(offer, self.limits)) is not None:
            return self._refused(*why)
        t0 = header_len
        tokens = np.frombuffer(body[t0 : t0 + 4 * n_tokens], dtype=TOKEN_DTYPE).copy()
        h0 = t0 + 4 * n_tokens
        self.hashes = [bytes(body[h0 + k * HASH_BYTES : h0 + (k + 1) * HASH_BYTES]) for k in range(n_hashes)]
        self.offer = offer
        self._state = _Rx.DECIDE
        return [OfferReceived(offer, tokens, self.hashes)]

    def _to_frames(self) -> None:
        self._state, self._need = _Rx.KIND, 1

    def _on_kind(self, unit: bytearray) -> list[ReceiverEvent]:
        kind = unit[0]
        if kind == Kind.BLOCK:
            self._state, self._need = _Rx.BLOCK, _BLOCK_REST.size
        elif kind == Kind.SNAPSHOT:
            self._state, self._need = _Rx.SNAP, _SNAP_REST.size
        elif kind == Kind.END:
            self._state, self._need = _Rx.END, _END_REST.size
        else:
            raise ProtocolError(Reason.MALFORMED, f"frame kind {kind} is not BLOCK, SNAPSHOT or END")
        return []

    def _on_snapshot(self, unit: bytearray) -> list[ReceiverEvent]:
        """The SNAPSHOT header: the one the offer announced, after the last block; its payload lands in a
        buffer of its own (its size was signed and within the limits)."""
        assert self.offer is not None
        pos, size, digest = _SNAP_REST.unpack(unit)
        offer = self.offer
        if not offer.snapshot_pos or self._snap_done or self._next != offer.n_blocks:
            return self._refused(Reason.ORDER, f"a snapshot arrived unannounced, twice, or before block {self._next} of {offer.n_blocks}")
        if (pos, size) != (offer.snapshot_pos, offer.snapshot_bytes):
            return self._refused(Reason.MALFORMED, f"a {size}-byte snapshot at {pos}; the offer announced "
                                                   f"{offer.snapshot_bytes} bytes at {offer.snapshot_pos}")
        self._snap, self._target, self._filled = (pos, digest), memoryview(bytearray(size)), 0
        self._state = _Rx.PAYLOAD
        return []

    def _on_block(self, unit: bytearray) -> list[ReceiverEvent]:
        assert self.offer is not None
        index, chain_hash, digest = _BLOCK_REST.unpack(unit)
        if index != self._next or index >= self.offer.n_blocks:
            return self._refused(Reason.ORDER, f"block {index} arrived; expected block {self._next} of {self.offer.n_blocks}")
        if chain_hash != self.hashes[index]:
            return self._refused(Reason.CHAIN, f"block {index}'s chain hash is not the offer's hash at {index}")
        header = BlockHeader(index, chain_hash, digest)
        self._header, self._target, self._filled = header, self._destination(header), 0
        self._state = _Rx.PAYLOAD
        return [header]

    def _destination(self, header: BlockHeader) -> memoryview:
        assert self.offer is not None
        size = self.offer.block_bytes
        target = self._provider(header) if self._provider is not None else None
        if target is None:
            return memoryview(bytearray(size))  # bounded: block_bytes passed the limits check
        view = _as_bytes_view(target)
        if view.readonly or len(view) != size:
            raise ProtocolError(Reason.STATE, f"payload target for block {header.index} must be writable and {size} bytes")
        return view

    def _fill_payload(self, view: memoryview, events: list[ReceiverEvent]) -> memoryview:
        assert self._target is not None
        n = min(len(view), len(self._target) - self._filled)
        self._target[self._filled : self._filled + n] = view[:n]
        self._filled += n
        if self._filled == len(self._target):
            events += self._payload_done()
        return view[n:]

    def _payload_done(self) -> list[ReceiverEvent]:
        if self._snap is not None:
            return self._snapshot_done()
        assert self._header is not None and self._target is not None
        h, data = self._header, self._target
        self._header, self._target = None, None
        if payload_digest(data) != h.digest:
            return self._refused(Reason.DIGEST, f"block {h.index}'s payload does not match its digest")
        self._end_mac.update(h.digest)
        self._next += 1
        self._to_frames()
        return [BlockReceived(h.index, h.chain_hash, h.digest, data)]

    def _snapshot_done(self) -> list[ReceiverEvent]:
        assert self._snap is not None and self._target is not None
        (pos, digest), data = self._snap, self._target
        self._snap, self._target = None, None
        if payload_digest(data) != digest:
            return self._refused(Reason.DIGEST, f"the snapshot at {pos}'s payload does not match its digest")
        self._end_mac.update(digest)
        self._snap_done = True
        self._to_frames()
        return [SnapshotReceived(pos, digest, data)]

    def _on_end(self, unit: bytearray) -> list[ReceiverEvent]:
        assert self.offer is not None and self.first_missing is not None
        count, mac = _END_REST.unpack(unit)
        if self.offer.snapshot_pos and not self._snap_done:
            return self._refused(Reason.INCOMPLETE, f"END before the snapshot at {self.offer.snapshot_pos} the offer announced")
        got = self._next - self.first_missing
        if self._next != self.offer.n_blocks or count != got:
            asked = self.offer.n_blocks - self.first_missing
            return self._refused(Reason.INCOMPLETE, f"END says {count} blocks; {got} arrived of the {asked} asked for")
        if not hmac.compare_digest(self._end_mac.digest(), mac):
            return self._refused(Reason.UNAUTHENTICATED, "the END mac does not authenticate the streamed digests")
        self._state = _Rx.RESULT
        return [EndReceived(count)]
