"""kv_share's sender state machine: encodes OFFER, BLOCK headers and END; decodes the replies.

Sans-I/O like the rest of the wire modules: the caller sends what it returns (and each block's
payload itself) and feeds back the receiver's bytes for `SenderEvent`s. Public through
`kvmesh.node.kvshare.wire`.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvmesh.node.engine.hashing import payload_digest
from kvmesh.node.kvshare.wire.events import Accepted, Completed, PeerRefused, SenderEvent
from kvmesh.node.kvshare.wire.frames import (
    _ANSWER_FIXED,
    _RESULT_FIXED,
    _STATUS_OK,
    _STATUS_REFUSED,
    MAC_BYTES,
    MAGIC,
    MAX_MESSAGE_BYTES,
    MAX_REASON_BYTES,
    VERSION,
    Kind,
    ProtocolError,
    Reason,
    _as_bytes_view,
    _keys,
    _mac,
    encode_block_header,
    encode_end,
    encode_offer,
    encode_snapshot_header,
)
from kvmesh.node.kvshare.wire.header import Offer

# ---- sender ----------------------------------------------------------------------------


class _Tx(enum.Enum):
    INIT = "before the offer"
    ANSWER = "awaiting the answer"
    ANSWER_TAIL = "answer tail"
    STREAM = "streaming blocks"
    RESULT_TAIL = "result tail"
    DONE = "done"
    FAILED = "failed"


class Sender:
    """Sender side of one transfer: encodes OFFER, BLOCK headers and END; decodes the replies."""

    def __init__(self, secret: bytes) -> None:
        self._key = _keys(secret, None)[0]
        self._state = _Tx.INIT
        self._need = 0
        self._acc = bytearray()
        self._fixed: tuple[int, ...] = ()
        self._fixed_bytes = b""
        self.offer: Offer | None = None
        self._hashes: list[bytes] = []
        self._offer_mac = b""
        self.first_missing: int | None = None
        self._next = 0
        self._end_mac: Any = None
        self._ended = False
        self._snapshot_sent = False

    @property
    def done(self) -> bool:
        return self._state in (_Tx.DONE, _Tx.FAILED)

    def want(self) -> int:
        return self._need - len(self._acc) if self._state not in (_Tx.INIT, _Tx.DONE, _Tx.FAILED) else 0

    # -- encoding

    def offer_bytes(self, offer: Offer, tokens: np.ndarray | Sequence[int], hashes: Sequence[bytes]) -> bytes:
        """The OFFER frame; the sender then waits for the ANSWER."""
        if self._state is not _Tx.INIT:
            raise ProtocolError(Reason.STATE, "one offer per transfer")
        frame, self._offer_mac = encode_offer(offer, tokens, hashes, self._key)
        self.offer, self._hashes = offer, list(hashes)
        self._state, self._need = _Tx.ANSWER, _ANSWER_FIXED.size
        return frame

    def block_header(self, index: int, payload: bytes | memoryview | np.ndarray | None = None, *, digest: bytes | None = None) -> bytes:
        """Header for block `index` (blocks go in order from first_missing); send the payload after it."""
        if self.first_missing is None or self._ended or self.offer is None:
            raise ProtocolError(Reason.STATE, "block_header() before an accepted answer or after end()")
        if index != self._next or index >= self.offer.n_blocks:
            raise ProtocolError(Reason.STATE, f"block {index} out of order; next is {self._next} of {self.offer.n_blocks}")
        if digest is None:
            if payload is None:
                raise ValueError("block_header needs the payload or its digest")
            size = _as_bytes_view(payload).nbytes
            if size != self.offer.block_bytes:
                raise ValueError(f"payload is {size} bytes; blocks are {self.offer.block_bytes}")
            digest = payload_digest(payload)
        self._end_mac.update(digest)
        self._next += 1
        return encode_block_header(index, self._hashes[index], digest)

    def snapshot_header(self, payload: bytes | memoryview | np.ndarray | None = None, *, digest: bytes | None = None) -> bytes:
        """Header of the snapshot the offer announced, after the last block; send the payload after it."""
        off = self.offer
        if self.first_missing is None or self._ended or off is None or self._snapshot_sent or not off.snapshot_pos:
            raise ProtocolError(Reason.STATE, "snapshot_header() without an announced snapshot, before the answer, twice or after end()")
        if self._next != off.n_blocks:
            raise ProtocolError(Reason.STATE, f"the snapshot goes after the last block; next is {self._next} of {off.n_blocks}")
        if digest is None:
            if payload is None:
                raise ValueError("snapshot_header needs the payload or its digest")
            if (size := _as_bytes_view(payload).nbytes) != off.snapshot_bytes:
                raise ValueError(f"the snapshot is {size} bytes; the offer says {off.snapshot_bytes}")
            digest = payload_digest(payload)
        self._end_mac.update(digest)
        self._snapshot_sent = True
        return encode_snapshot_header(off.snapshot_pos, off.snapshot_bytes, digest)

    def end(self) -> bytes:
        """END: the count and the mac over the offer's mac and every streamed digest (the snapshot's last)."""
        if self.first_missing is None or self._ended:
            raise ProtocolError(Reason.STATE, "end() before an accepted answer, or twice")
        if self.offer is not None and self.offer.snapshot_pos and not self._snapshot_sent:
            raise ProtocolError(Reason.STATE, "end() before the announced snapshot was sent")
        self._ended = True
        return encode_end(self._next - self.first_missing, self._end_mac.digest())

    # -- decoding the receiver's replies

    def feed(self, data: bytes | bytearray | memoryview) -> list[SenderEvent]:
        if self._state is _Tx.FAILED:
            raise ProtocolError(Reason.STATE, "this transfer already failed")
        if self._state is _Tx.INIT and len(data):
            raise ProtocolError(Reason.UNEXPECTED, "reply bytes before the offer was sent")
        view = _as_bytes_view(data)
        events: list[SenderEvent] = []
        try:
            while len(view) and self._state not in (_Tx.DONE, _Tx.INIT):
                take = min(self._need - len(self._acc), len(view))
                self._acc += view[:take]
                view = view[take:]
                if self._state is _Tx.ANSWER:
                    n = min(len(self._acc), len(MAGIC))
                    if self._acc[:n] != MAGIC[:n]:
                        raise ProtocolError(Reason.MALFORMED, "not a kv_share answer (bad magic)")
                if len(self._acc) == self._need:
                    unit, self._acc = bytes(self._acc), bytearray()
                    events += self._on_unit(unit)
        except ProtocolError:
            self._state = _Tx.FAILED
            raise
        return events

    def eof(self) -> list[SenderEvent]:
        """The receiver closed. Fine once it has said its last word; otherwise truncated."""
        if self._state in (_Tx.DONE, _Tx.FAILED):
            return []
        where = self._state.value
        self._state = _Tx.FAILED
        raise ProtocolError(Reason.TRUNCATED, f"the receiver closed the connection while {where}")

    def _on_unit(self, unit: bytes) -> list[SenderEvent]:
        if self._state is _Tx.ANSWER:
            _, version, kind, status, first_missing, rlen, mlen = _ANSWER_FIXED.unpack(unit)
            if version != VERSION:
                raise ProtocolError(Reason.VERSION, f"receiver speaks kv_share version {version}")
            if kind != Kind.ANSWER:
                raise ProtocolError(Reason.UNEXPECTED, f"expected an ANSWER, got frame kind {kind}")
            return self._fixed_done(unit, (status, first_missing, rlen, mlen), _Tx.ANSWER_TAIL)
        if self._state is _Tx.STREAM:
            kind, status, tokens, rlen, mlen = _RESULT_FIXED.unpack(unit)
            if kind != Kind.RESULT:
                raise ProtocolError(Reason.UNEXPECTED, f"expected a RESULT, got frame kind {kind}")
            return self._fixed_done(unit, (status, tokens, rlen, mlen), _Tx.RESULT_TAIL)
        return self._on_tail(unit)

    def _fixed_done(self, unit: bytes, fields: tuple[int, ...], tail: _Tx) -> list[SenderEvent]:
        status, _, rlen, mlen = fields
        if status not in (_STATUS_OK, _STATUS_REFUSED):
            raise ProtocolError(Reason.MALFORMED, f"reply status {status} is neither ok nor refused")
        if rlen > MAX_REASON_BYTES or mlen > MAX_MESSAGE_BYTES:
            most = f"{MAX_REASON_BYTES}/{MAX_MESSAGE_BYTES}"
            raise ProtocolError(Reason.OVERSIZED, f"reply reason/message of {rlen}/{mlen} bytes exceed {most}")
        self._fixed, self._fixed_bytes = fields, unit
        self._state, self._need = tail, rlen + mlen + MAC_BYTES
        return []

    def _on_tail(self, tail: bytes) -> list[SenderEvent]:
        assert self.offer is not None
        status, value, rlen, mlen = self._fixed
        stage = "answer" if self._state is _Tx.ANSWER_TAIL else "result"
        frame, mac = self._fixed_bytes + tail[:-MAC_BYTES], tail[-MAC_BYTES:]
        signed = hmac.compare_digest(_mac(self._key, self._offer_mac, frame), mac)
        if status == _STATUS_REFUSED:
            try:
                reason = tail[:rlen].decode("ascii")
            except UnicodeDecodeError:
                raise ProtocolError(Reason.MALFORMED, "refusal reason is not ASCII") from None
            message = tail[rlen : rlen + mlen].decode("utf-8", "replace")
            self._state = _Tx.DONE
            return [PeerRefused(stage, reason, message, signed)]
        if not signed:
            raise ProtocolError(Reason.UNAUTHENTICATED, f"the receiver's {stage} is not signed with the mesh secret")
        if stage == "answer":
            if value > self.offer.n_blocks:
                raise ProtocolError(Reason.MALFORMED, f"first_missing {value} is past the {self.offer.n_blocks} offered blocks")
            self.first_missing = self._next = value
            self._end_mac = hmac.new(self._key, self._offer_mac, hashlib.sha256)
            self._state, self._need = _Tx.STREAM, _RESULT_FIXED.size
            return [Accepted(value)]
        if not self._ended:
            raise ProtocolError(Reason.UNEXPECTED, "an ok result arrived before END was sent")
        self._state = _Tx.DONE
        return [Completed(value)]
