"""kv_share v2 frame layouts: constants, reason codes, the HMACs, encoders and keyless peeks.

Everything both sides share about the bytes: the sender and receiver state machines
(`sender`, `receiver`) build and parse frames with these layouts, and fault proxies
read offers and answers without the key. No I/O. Public through `kvmesh.node.kvshare.wire`.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from kvmesh.node.engine.hashing import HASH_BYTES, TOKEN_DTYPE
from kvmesh.node.errors import KVMeshError
from kvmesh.node.kvshare.wire.header import Offer

MAGIC = b"KVSH"
VERSION = 2  # 2: a state snapshot may follow the blocks (SNAPSHOT); 1 had blocks alone
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
    SNAPSHOT = 6


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
    SNAPSHOT = "snapshot"  # a snapshot whose cells do not check (node.engine.snapshots)


class ProtocolError(KVMeshError):
    """The kv_share byte stream is broken (or the API was used out of order)."""

    code = "kvshare_protocol_error"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = str(reason)


# ---- encoders ----------------------------------------------------------------------

_OFFER_PREFIX = struct.Struct("<4sBBIII")
_BLOCK_REST = struct.Struct("<I16s16s")
_END_REST = struct.Struct("<I32s")
_SNAP_REST = struct.Struct("<IQ16s")
_ANSWER_FIXED = struct.Struct("<4sBBBIHH")
_RESULT_FIXED = struct.Struct("<BBQHH")
_STATUS_OK, _STATUS_REFUSED = 0, 1
BLOCK_HEADER_BYTES = 1 + _BLOCK_REST.size
SNAPSHOT_HEADER_BYTES = 1 + _SNAP_REST.size
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


def _as_bytes_view(data: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    mv = memoryview(cast("bytes", data))  # numpy arrays are buffers too; the stubs disagree
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


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


def encode_snapshot_header(pos: int, nbytes: int, digest: bytes) -> bytes:
    """The 29 bytes that precede the snapshot's payload: its position, its size, its payload digest."""
    return bytes([Kind.SNAPSHOT]) + _SNAP_REST.pack(pos, nbytes, digest)


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
    bytes are needed. ProtocolError: the stream is not a kv_share offer of this version."""
    if len(head) < _OFFER_PREFIX.size:
        return None
    magic, version, kind, header_len, n_tokens, n_hashes = _OFFER_PREFIX.unpack_from(head)
    if magic != MAGIC or version != VERSION or kind != Kind.OFFER:
        raise ProtocolError(Reason.UNEXPECTED, f"not a kv_share v{VERSION} OFFER")
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
        raise ProtocolError(Reason.UNEXPECTED, f"not a kv_share v{VERSION} ANSWER")
    return int(first_missing)
