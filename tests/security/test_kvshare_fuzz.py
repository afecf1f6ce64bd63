"""The live kv_share listener fuzzed with random, truncated and corrupted frames (hypothesis).

The pure parser is fuzzed in tests/kvshare/test_wire.py; here the bytes go to a running node's
listener over TCP. A valid stream (an OFFER of real chain hashes made with `wire.Sender`, its
BLOCKs and END) is the seed for truncations and bit flips; offers signed with the real secret but
with fuzzed headers (hostile session ids, wrong shapes and counts) stand for a buggy peer. After the fuzz: no receive thread is
left, no thread died of an exception, nothing reached the store or the engine, and the node still
takes a valid replica and answers /health.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.node.engine.hashing import block_hashes, chain_seed
from kvmesh.node.engine.simkv import block_bytes
from kvmesh.node.kvshare import wire
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread
from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.protocol import session_key

from .helpers import sim_config, tree

SECRET = "kvshare-fuzz-secret-0123456789"
FUZZ_SESSION = "kvfuzz-s"
N_BLOCKS = 3


@dataclass
class Target:
    srv: ThreadedServer
    store: Path
    addr: tuple[str, int]
    stream: bytes  # a whole valid transfer of FUZZ_SESSION: OFFER | BLOCK... | END
    frames: list[int]  # offsets where each frame starts (and the end)


def _addr(s: str) -> tuple[str, int]:
    host, port = s.rsplit(":", 1)
    return host, int(port)


def make_offer(srv: ThreadedServer, session: str, n_blocks: int, seed: int) -> tuple[wire.Offer, np.ndarray, list[bytes]]:
    e = srv.node.engine
    toks = np.random.default_rng(seed).integers(0, 256, n_blocks * e.block_size, dtype=np.int32)
    hashes = block_hashes(e.seed_hash, toks, e.block_size)
    offer = wire.Offer(session=session, sender="fuzzer", fingerprint=e.fingerprint, block_size=e.block_size,
                       block_bytes=e.block_bytes, n_blocks=n_blocks, generation=1, sent_at=1.0)
    return offer, toks, hashes


def payload(offer: wire.Offer, toks: np.ndarray, hashes: list[bytes], i: int) -> bytes:
    """Block i's sim KV bytes (what a sim engine holds for these tokens)."""
    bs = offer.block_size
    prev = hashes[i - 1] if i else chain_seed(offer.fingerprint)
    return block_bytes(prev, toks[i * bs : (i + 1) * bs], offer.block_bytes // bs, bs)


def valid_stream(srv: ThreadedServer, secret: bytes, session: str) -> tuple[bytes, list[int]]:
    """OFFER + every BLOCK + END of one transfer, as a sender that was told first_missing=0 would send it."""
    offer, toks, hashes = make_offer(srv, session, N_BLOCKS, seed=7)
    tx = wire.Sender(secret)
    parts = [tx.offer_bytes(offer, toks, hashes)]
    _, offer_mac = wire.encode_offer(offer, toks, hashes, secret)  # HMAC: the same mac the sender keeps
    assert tx.feed(wire.encode_answer(secret, offer_mac, first_missing=0)) == [wire.Accepted(0)]
    for i in range(N_BLOCKS):
        p = payload(offer, toks, hashes, i)
        parts.append(tx.block_header(i, p) + p)
    parts.append(tx.end())
    offsets, at = [], 0
    for p in parts:
        offsets.append(at)
        at += len(p)
    offsets.append(at)
    return b"".join(parts), offsets


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    store = tmp_path_factory.mktemp("kvfuzz-store")
    cfg = sim_config("kvfuzz", mesh={"secret": SECRET},
                     kvshare={"store_dir": str(store), "io_timeout_s": 2.0, "socket_buffer_bytes": 65536})
    srv = serve_in_thread(cfg)
    try:
        stream, frames = valid_stream(srv, SECRET.encode(), FUZZ_SESSION)
        yield Target(srv, store, _addr(srv.node.kvshare.address), stream, frames)
    finally:
        srv.stop()


def send_and_close(addr: tuple[str, int], data: bytes, timeout: float = 10.0) -> bytes:
    """Send `data`, close our side, read until the listener closes (fails if it does not within `timeout`)."""
    got = b""
    with socket.create_connection(addr, timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # EPIPE, ECONNRESET, ENOTCONN: it refused and closed while we were still sending
            return got
        deadline = time.monotonic() + timeout
        try:
            while chunk := s.recv(65536):
                got += chunk
                assert time.monotonic() < deadline, "the listener keeps talking"
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail(f"the listener kept a closed-by-sender connection open for {timeout:g}s")
    return got


def recv_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvshare-recv" and t.is_alive()]


# Fuzz inputs: random bytes, bytes behind a valid magic/version/kind, truncations of the valid stream (biased to
# frame edges), the valid stream with bytes flipped (optionally truncated too), and signed offers with fuzzed headers.
_prefixes = [b"", wire.MAGIC, wire.MAGIC + bytes([wire.VERSION]), wire.MAGIC + bytes([wire.VERSION, wire.Kind.OFFER])]


@dataclass(frozen=True)
class FuzzCase:
    kind: str
    data: bytes
    recipe: str  # how it was made from the valid stream (a repro), or ""

    def __repr__(self) -> str:
        return f"FuzzCase({self.kind}, {len(self.data)} bytes, {self.recipe or self.data[:80]!r})"


HOSTILE_SESSIONS = ["../../x", "..", ".", "a/b", "a\x00b", "s\u00e9ssion", "x" * 129, "", " ", "..\\x", FUZZ_SESSION]


@st.composite
def signed_offer(draw: st.DrawFn, fingerprint: str, block_size: int, block_bytes: int) -> FuzzCase:
    """An OFFER signed with the mesh secret (a buggy or compromised peer) whose header and counts are fuzzed."""
    n_blocks = draw(st.integers(0, 3))
    header: dict[str, object] = {
        "session": draw(st.one_of(st.sampled_from(HOSTILE_SESSIONS), st.text(max_size=20))),
        "sender": draw(st.one_of(st.just("peer"), st.text(max_size=10))),
        "fingerprint": draw(st.sampled_from([fingerprint, "other-model", ""])),
        "block_size": draw(st.sampled_from([block_size, 0, 1, -1, 1 << 21])),
        "block_bytes": draw(st.sampled_from([block_bytes, 0, 1, 1 << 41])),
        "n_blocks": draw(st.sampled_from([n_blocks, n_blocks + 1, 1 << 32])),
        "generation": draw(st.sampled_from([1, 0, -1, 1 << 63])),
        "sent_at": draw(st.sampled_from([1.0, float("nan"), 1e300])),
    }
    for key in draw(st.lists(st.sampled_from(sorted(header)), max_size=2, unique=True)):
        del header[key]
    if draw(st.booleans()):
        header["extra"] = draw(st.text(max_size=5))
    raw = json.dumps(header).encode() if draw(st.integers(0, 9)) else draw(st.binary(max_size=40))
    n_tokens = draw(st.sampled_from([n_blocks * block_size, n_blocks * block_size + 1, 0]))
    toks = np.asarray(draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n_tokens, max_size=n_tokens)), dtype="<i4")
    hashes = b"".join(draw(st.binary(min_size=16, max_size=16)) for _ in range(n_blocks))
    body = struct.pack("<4sBBIII", wire.MAGIC, wire.VERSION, wire.Kind.OFFER, len(raw), n_tokens, n_blocks)
    body += raw + toks.tobytes() + hashes
    frame = body + hmac.new(SECRET.encode(), body, hashlib.sha256).digest()
    return FuzzCase("signed", frame, f"signed offer {raw[:120]!r}, {n_tokens} tokens, {n_blocks} hashes")


@st.composite
def fuzz_input(draw: st.DrawFn, stream: bytes, frames: list[int], engine: tuple[str, int, int]) -> FuzzCase:
    kind = draw(st.sampled_from(["random", "prefixed", "truncated", "flipped", "signed"]))
    if kind == "signed":
        return draw(signed_offer(*engine))
    if kind == "random":
        return FuzzCase(kind, draw(st.binary(max_size=256)), "")
    if kind == "prefixed":
        return FuzzCase(kind, draw(st.sampled_from(_prefixes)) + draw(st.binary(max_size=256)), "")
    edges = sorted({max(0, min(len(stream) - 1, f + d)) for f in frames for d in (-1, 0, 1)})
    if kind == "truncated":
        cut = draw(st.one_of(st.sampled_from(edges), st.integers(0, len(stream) - 1)))
        return FuzzCase(kind, stream[:cut], f"stream[:{cut}]")
    data = bytearray(stream)
    flips = []
    for pos in draw(st.lists(st.one_of(st.sampled_from(edges), st.integers(0, len(stream) - 1)), min_size=1, max_size=3,
                             unique=True)):
        x = draw(st.integers(1, 255))
        data[pos] ^= x
        flips.append(f"[{pos}]^={x}")
    cut = draw(st.one_of(st.just(len(data)), st.integers(0, len(data))))
    return FuzzCase(kind, bytes(data[:cut]), f"stream{''.join(flips)} then [:{cut}]")


def test_fuzzed_frames_are_refused_without_a_trace_and_the_listener_keeps_serving(target: Target,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Random, truncated, bit-flipped and signed-but-malformed kv_share streams: closed or refused, no thread dies, nothing lands, a valid transfer still does."""
    srv, addr = target.srv, target.addr
    store_before = tree(target.store)
    crashed: list[str] = []
    default_hook = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        crashed.append(f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}")
        default_hook(args)

    monkeypatch.setattr(threading, "excepthook", hook)
    kinds: dict[str, int] = {}
    answers: dict[str, int] = {}

    e = srv.node.engine

    @settings(max_examples=200, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(case=fuzz_input(target.stream, target.frames, (e.fingerprint, e.block_size, e.block_bytes)))
    def one(case: FuzzCase) -> None:
        kinds[case.kind] = kinds.get(case.kind, 0) + 1
        reply = send_and_close(addr, case.data)
        if reply:  # whatever the listener answers starts with an ANSWER frame
            assert reply.startswith(wire.MAGIC) and len(reply) >= 7, reply[:64]
            answers["accepted" if reply[6] == 0 else "refused"] = answers.get("accepted" if reply[6] == 0 else "refused", 0) + 1
        else:
            answers["closed"] = answers.get("closed", 0) + 1
        assert not crashed, crashed

    one()
    assert all(kinds.get(k, 0) >= 10 for k in ("random", "prefixed", "truncated", "flipped", "signed")), kinds
    # The fuzz went deep: some streams were closed unanswered, some refused at the offer, some accepted and
    # then cut or refused inside the blocks or END.
    assert all(answers.get(k, 0) >= 5 for k in ("closed", "refused", "accepted")), answers

    # Every receive thread ended; none died of an unexpected exception.
    wait_for(lambda: not recv_threads(), "every kv_share receive thread to end", timeout=10)
    assert not crashed, crashed
    # Nothing of the fuzzed sessions reached the engine or the store; no temp file, no session directory.
    assert e.resident_tokens(FUZZ_SESSION) == 0
    assert list(e.sessions) == [], list(e.sessions)
    assert tree(target.store) == store_before, (store_before, tree(target.store))
    assert not [p for p in target.store.rglob("*") if p.name.startswith("~")]

    # The listener keeps serving: a valid transfer of another session lands whole, and the API answers.
    offer, toks, hashes = make_offer(srv, "kvfuzz-after", N_BLOCKS, seed=11)
    tx = wire.Sender(SECRET.encode())
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(tx.offer_bytes(offer, toks, hashes))
        ev = read_one(s, tx)
        assert ev == wire.Accepted(0), ev
        for i in range(N_BLOCKS):
            p = payload(offer, toks, hashes, i)
            s.sendall(tx.block_header(i, p) + p)
        s.sendall(tx.end())
        done = read_one(s, tx)
    # Imported into the engine (not the no-room store path): no fuzzed transfer leaked reserved KV blocks.
    assert done == wire.Completed(N_BLOCKS * e.block_size), done
    assert e.resident_tokens("kvfuzz-after") == N_BLOCKS * e.block_size
    wait_for(lambda: (target.store / session_key("kvfuzz-after") / "manifest.json").exists(),
             "the replica's write-behind to the store")
    assert sorted(p.name for p in target.store.iterdir()) == [session_key("kvfuzz-after")]
    assert not [p for p in target.store.rglob("*") if p.name.startswith("~")]
    r = httpx.get(srv.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert not crashed, crashed


def read_one(s: socket.socket, tx: wire.Sender) -> wire.SenderEvent:
    while True:
        data = s.recv(max(1, tx.want()))
        events = tx.feed(data) if data else tx.eof()
        if events:
            return events[0]
