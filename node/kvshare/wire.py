"""kv_share wire protocol, version 1: encoders and incremental decoders, no I/O.

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
    END    kind u8 | block count u32 | HMAC(secret, offer mac || payload digests in order)

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
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvmesh.node.engine.hashing import HASH_BYTES, TOKEN_DTYPE, payload_digest
from kvmesh.node.errors import InvalidRequest, KVMeshError
from kvmesh.node.protocol import SessionId, session_id_problem

MAGIC = b"KVSH"
VERSION = 1
MAC_BYTES = 32
DIGEST_BYTES = 16
MAX_REASON_BYTES = 64
MAX_MESSAGE_BYTES = 1024



class Kind(enum.IntEnum):
    OFFER = 1
    ANSWER = 2
    BLOCK = 3
    END = 4
    RESULT = 5


class Reason(enum.StrEnum):
    """Reason codes carried by `ProtocolError`, `Refused` and refusal frames."""

    UNAUTHENTICATED = "unauthenticated"
    MALFORMED = "malformed"
    VERSION = "version"
    OVERSIZED = "oversized"
    TRUNCATED = "truncated"
    UNEXPECTED = "unexpected"
    STATE = "state"
    ORDER = "order"
    CHAIN = "chain"
    DIGEST = "digest"
    INCOMPLETE = "incomplete"
    FINGERPRINT = "fingerprint"
    BUSY = "busy"
    NO_ROOM = "no_room"
    STALE = "stale"
    IMPORT_FAILED = "import_failed"
    INTERNAL = "internal"


class ProtocolError(KVMeshError):
    """The kv_share byte stream is broken (or the API was used out of order)."""

    code = "kvshare_protocol_error"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = str(reason)


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

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_blocks", "max_tokens", "max_block_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be positive")


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


ReceiverEvent = OfferReceived | BlockHeader | BlockReceived | EndReceived | Refused
SenderEvent = Accepted | Completed | PeerRefused
PayloadTarget = Callable[[BlockHeader], "memoryview | None"]

# ---- encoders ----------------------------------------------------------------------

_OFFER_PREFIX = struct.Struct("<4sBBIII")
_BLOCK_REST = struct.Struct("<I16s16s")
_END_REST = struct.Struct("<I32s")
_ANSWER_FIXED = struct.Struct("<4sBBBIHH")
_RESULT_FIXED = struct.Struct("<BBQHH")
_STATUS_OK, _STATUS_REFUSED = 0, 1
BLOCK_HEADER_BYTES = 1 + _BLOCK_REST.size
_ZERO_MAC = bytes(MAC_BYTES)


def _mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def _keys(secret: bytes, previous: bytes | None) -> list[bytes]:
    if not secret:
        raise ValueError("the mesh secret must not be empty")
    return [secret] + ([previous] if previous else [])


def encode_offer(offer: Offer, tokens: np.ndarray | Sequence[int], hashes: Sequence[bytes], secret: bytes) -> tuple[bytes, bytes]:
    """The OFFER frame and its mac (the sender keeps the mac for END)."""
    toks = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
    if len(toks) != offer.num_tokens or len(hashes) != offer.n_blocks:
        raise ValueError(f"offer says {offer.n_blocks} blocks of {offer.block_size}; got {len(toks)} tokens, {len(hashes)} hashes")
    if any(len(h) != HASH_BYTES for h in hashes):
        raise ValueError("every block hash must be 16 bytes")
    header = offer.model_dump_json().encode()
    body = b"".join(
        [_OFFER_PREFIX.pack(MAGIC, VERSION, Kind.OFFER, len(header), len(toks), len(hashes)), header, toks.tobytes(), *hashes]
    )
    mac = _mac(secret, body)
    return body + mac, mac


def encode_block_header(index: int, chain_hash: bytes, digest: bytes) -> bytes:
    """The 37 bytes that precede a block's payload (the caller sends the payload itself)."""
    return bytes([Kind.BLOCK]) + _BLOCK_REST.pack(index, chain_hash, digest)


def encode_end(count: int, mac: bytes) -> bytes:
    return bytes([Kind.END]) + _END_REST.pack(count, mac)


def _reason_message(reason: str, message: str) -> tuple[bytes, bytes]:
    r = str(reason).encode("ascii", "replace")[:MAX_REASON_BYTES]
    m = message.encode("utf-8")[:MAX_MESSAGE_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return r, m


def encode_answer(
    key: bytes | None, offer_mac: bytes, *, first_missing: int = 0, reason: str | None = None, message: str = ""
) -> bytes:
    """ANSWER: accept from `first_missing`, or refuse with `reason`. `key=None`: unsigned (zeros)."""
    status = _STATUS_OK if reason is None else _STATUS_REFUSED
    r, m = _reason_message(reason or "", message if reason else "")
    frame = _ANSWER_FIXED.pack(MAGIC, VERSION, Kind.ANSWER, status, first_missing, len(r), len(m)) + r + m
    return frame + (_mac(key, offer_mac, frame) if key else _ZERO_MAC)


def encode_result(key: bytes | None, offer_mac: bytes, *, tokens: int = 0, reason: str | None = None, message: str = "") -> bytes:
    """RESULT: ok with the tokens now resident, or refused with `reason`."""
    status = _STATUS_OK if reason is None else _STATUS_REFUSED
    r, m = _reason_message(reason or "", message if reason else "")
    frame = _RESULT_FIXED.pack(Kind.RESULT, status, tokens, len(r), len(m)) + r + m
    return frame + (_mac(key, offer_mac, frame) if key else _ZERO_MAC)


# ---- observers: reading frames without the key (fault proxies) ------------------------------


@dataclass(frozen=True)
class OfferFrame:
    """What an observer without the key reads of an OFFER: the whole frame's length (blocks start
    right after it) and its header JSON, NOT authenticated."""

    length: int
    header: dict[str, Any]


def peek_offer(head: bytes | bytearray | memoryview) -> OfferFrame | None:
    """The OFFER at the start of `head`, once `head` holds its prefix and header; None while more
    bytes are needed. ProtocolError: the stream is not a kv_share v1 offer."""
    if len(head) < _OFFER_PREFIX.size:
        return None
    magic, version, kind, header_len, n_tokens, n_hashes = _OFFER_PREFIX.unpack_from(head)
    if magic != MAGIC or version != VERSION or kind != Kind.OFFER:
        raise ProtocolError(Reason.UNEXPECTED, "not a kv_share v1 OFFER")
    end = _OFFER_PREFIX.size + header_len
    if len(head) < end:
        return None
    try:
        header = json.loads(bytes(head[_OFFER_PREFIX.size : end]))
    except ValueError as e:
        raise ProtocolError(Reason.MALFORMED, f"the OFFER header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(Reason.MALFORMED, "the OFFER header is not a JSON object")
    return OfferFrame(end + 4 * n_tokens + HASH_BYTES * n_hashes + MAC_BYTES, header)


def peek_answer(head: bytes | bytearray | memoryview) -> int | None:
    """The first missing block an ANSWER at the start of `head` asks for, once `head` holds the
    ANSWER's fixed part; None while more bytes are needed. ProtocolError: not an ANSWER."""
    if len(head) < _ANSWER_FIXED.size:
        return None
    magic, version, kind, _status, first_missing, _rlen, _mlen = _ANSWER_FIXED.unpack_from(head)
    if magic != MAGIC or version != VERSION or kind != Kind.ANSWER:
        raise ProtocolError(Reason.UNEXPECTED, "not a kv_share v1 ANSWER")
    return int(first_missing)


# ---- receiver --------------------------------------------------------------------------


class _Rx(enum.Enum):
    PREFIX = "offer prefix"
    BODY = "offer body"
    DECIDE = "awaiting accept() or refuse()"
    KIND = "frame kind"
    BLOCK = "block header"
    PAYLOAD = "block payload"
    END = "end frame"
    RESULT = "awaiting result_ok() or refuse()"
    FAILED = "failed"
    DONE = "done"


def _as_bytes_view(data: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    mv = memoryview(cast("bytes", data))  # numpy arrays are buffers too; the stubs disagree
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


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
        if self._state in (_Rx.PREFIX, _Rx.BODY, _Rx.KIND, _Rx.BLOCK, _Rx.END):
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
        elif kind == Kind.END:
            self._state, self._need = _Rx.END, _END_REST.size
        else:
            raise ProtocolError(Reason.MALFORMED, f"frame kind {kind} is not BLOCK or END")
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
        assert self._header is not None and self._target is not None
        h, data = self._header, self._target
        self._header, self._target = None, None
        if payload_digest(data) != h.digest:
            return self._refused(Reason.DIGEST, f"block {h.index}'s payload does not match its digest")
        self._end_mac.update(h.digest)
        self._next += 1
        self._to_frames()
        return [BlockReceived(h.index, h.chain_hash, h.digest, data)]

    def _on_end(self, unit: bytearray) -> list[ReceiverEvent]:
        assert self.offer is not None and self.first_missing is not None
        count, mac = _END_REST.unpack(unit)
        got = self._next - self.first_missing
        if self._next != self.offer.n_blocks or count != got:
            asked = self.offer.n_blocks - self.first_missing
            return self._refused(Reason.INCOMPLETE, f"END says {count} blocks; {got} arrived of the {asked} asked for")
        if not hmac.compare_digest(self._end_mac.digest(), mac):
            return self._refused(Reason.UNAUTHENTICATED, "the END mac does not authenticate the streamed digests")
        self._state = _Rx.RESULT
        return [EndReceived(count)]


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

    def end(self) -> bytes:
        """END: the count and the mac over the offer's mac and every streamed digest."""
        if self.first_missing is None or self._ended:
            raise ProtocolError(Reason.STATE, "end() before an accepted answer, or twice")
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
