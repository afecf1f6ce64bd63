"""kv_share transfers that must not land, against real node processes: offers signed with a wrong secret
(and rotation: the previous secret still works), one bit flipped in a block's payload, a connection dropped
half-way, and garbage, truncated, oversized or malformed offers on the listener. Each is refused (or the
connection closed), leaves nothing in b's engine or store (no session directory, no temporary files), and
b keeps serving: a valid transfer afterwards lands in full.

Faults come from a proxy on the a -> b path (a's real sender) or from a hand-driven `wire.Sender`.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
from typing import Literal

import numpy as np
import pytest
from support.conversation import Conversation

from kvmesh.node.lab.chaos.proxy import Fault
from kvmesh.node.engine.hashing import block_hashes, chain_seed
from kvmesh.node.kvshare import wire
from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.protocol import ReplicaReady, ReplicaRefused, session_key

from .service_helpers import BLOCK, Pair, hand_offer, hand_send, read_reply


def assert_nothing_landed(p: Pair, session: str) -> None:
    held = p.holding("b", session)
    assert held["resident_tokens"] == 0 and held["store_tokens"] == 0, f"b holds some of {session}: {held}"
    assert not (p.store_dir("b") / session_key(session)).exists(), f"b's store has a directory for {session}"
    assert p.temp_files("b") == [], "temporary files left in b's store"


def imported_blocks(p: Pair) -> int:
    return int(p.stats("b")["engine"]["imported_blocks"])


def test_wrong_secret_is_refused_and_the_previous_secret_is_accepted(kv_pair: Pair) -> None:
    """An offer signed with a wrong secret is refused ('unauthenticated') and imports nothing; the previous secret works."""
    p = kv_pair
    facts = p.facts["b"]
    wrong, prev, cur = (Conversation(f"auth-{k}", chars=9 * BLOCK) for k in ("wrong", "prev", "cur"))
    offers = {c.session: hand_offer(facts, c.session, c.tokens()) for c in (wrong, prev, cur)}
    refused0 = p.refused_in("b", "unauthenticated")
    imported0 = imported_blocks(p)
    with p.events("b") as ev_b:
        res = hand_send(p.kv["b"], "not-the-mesh-secret-at-all", offers[wrong.session])
        assert isinstance(res, wire.PeerRefused), res
        assert (res.stage, res.reason, res.authenticated) == ("answer", "unauthenticated", False)
        ev_b.wait_live(ReplicaRefused, reason="unauthenticated")
        assert p.refused_in("b", "unauthenticated") == refused0 + 1
        assert imported_blocks(p) == imported0
        assert_nothing_landed(p, wrong.session)

        for conv, key in ((prev, p.previous_secret), (cur, p.secret)):
            n = offers[conv.session].offer.n_blocks
            res = hand_send(p.kv["b"], key, offers[conv.session])
            assert res == wire.Completed(n * BLOCK), f"{conv.session}: {res}"
            ready = ev_b.wait_live(ReplicaReady, session=conv.session)
            assert ready.blocks == n and ready.imported is True and ready.src == "hand"
        assert ev_b.live(ReplicaReady, session=wrong.session) == []
    # The refused session runs cold on b; the one signed with the previous secret runs warm.
    assert p.turn("b", wrong).cached == 0
    n = offers[prev.session].offer.n_blocks
    assert p.turn("b", prev).cached == n * BLOCK


def test_bit_flipped_in_transit_is_refused_and_nothing_lands(kv_pair: Pair) -> None:
    """One bit flipped in a block's payload between a and b: b refuses ('digest'), imports and stores nothing, keeps serving."""
    p = kv_pair
    conv = Conversation("corrupt-proxy", chars=1500)
    imported0 = imported_blocks(p)
    digest0 = p.refused_in("b", "digest")
    f = p.proxy.arm(Fault("flip", conv.session, block=3, byte=100, bit=0))
    with p.events("a") as ev_a, p.events("b") as ev_b:
        t = p.turn("a", conv)
        n = t.prompt_tokens // BLOCK
        refused = ev_b.wait_live(ReplicaRefused, session=conv.session)
        ev_a.wait_live(ReplicaRefused, session=conv.session)  # a's push ended (its reason: whatever a saw)
        assert f.fired.is_set() and "flipped" in f.info, f"the proxy did not flip the bit: {f.info}"
        assert refused.reason == "digest" and refused.src == "a", refused
        assert p.refused_in("b", "digest") == digest0 + 1
        assert ev_b.live(ReplicaReady, session=conv.session) == []
        assert imported_blocks(p) == imported0
        assert_nothing_landed(p, conv.session)
        # b keeps serving: the same replica, pushed again, lands in full (b kept no block of the refused one).
        r = p.admin("a", f"/v1/admin/sessions/{conv.session}/replicate")
        assert r.status_code == 200 and r.json()["ok"], r.text
        ready = ev_b.wait_live(ReplicaReady, session=conv.session)
    assert ready.blocks == n and ready.tokens == n * BLOCK, ready
    assert p.holding("b", conv.session)["resident_tokens"] == n * BLOCK


def test_bit_flipped_by_a_hand_driven_sender_is_refused_with_digest(kv_pair: Pair) -> None:
    """A block whose payload does not match its digest is refused ('digest', signed); a resend then lands whole."""
    p = kv_pair
    conv = Conversation("corrupt-hand", chars=6 * BLOCK)
    ho = hand_offer(p.facts["b"], conv.session, conv.tokens())
    n = ho.offer.n_blocks
    imported0 = imported_blocks(p)
    res = hand_send(p.kv["b"], p.secret, ho, corrupt=2)
    assert isinstance(res, wire.PeerRefused), res
    assert (res.stage, res.reason, res.authenticated) == ("result", "digest", True)
    wait_for(lambda: p.stats("b")["kvshare"]["in"].get("hand", {}).get("refused", {}).get("digest"),
             "b to count the digest refusal from 'hand'")
    assert imported_blocks(p) == imported0
    assert_nothing_landed(p, conv.session)
    # The probe: another session with the same tokens finds nothing of them in b's engine.
    assert p.turn("b", conv.twin("corrupt-hand-probe")).cached == 0
    with p.events("b") as ev_b:
        assert hand_send(p.kv["b"], p.secret, hand_offer(p.facts["b"], "corrupt-hand-2", conv.tokens())) \
            == wire.Completed(n * BLOCK)
        ev_b.wait_live(ReplicaReady, session="corrupt-hand-2")


def test_refusal_reaches_a_sender_that_is_still_streaming(kv_pair: Pair) -> None:
    """A sender that streams every block (as the node's sender does) before reading still learns the 'digest' refusal."""
    p = kv_pair
    conv = Conversation("corrupt-streaming", chars=40 * BLOCK)
    ho = hand_offer(p.facts["b"], conv.session, conv.tokens())
    tx = wire.Sender(p.secret.encode())
    with _connect(p.kv["b"]) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        sock.sendall(tx.offer_bytes(ho.offer, ho.tokens, ho.hashes))
        assert read_reply(sock, tx) == wire.Accepted(0)
        res: object
        try:
            for i in range(ho.offer.n_blocks):  # the loop of KVShare._send_blocking
                pl = ho.payload(i)
                hdr = tx.block_header(i, memoryview(pl))
                if i == 1:
                    pl[100] ^= 0x01
                sock.sendall(hdr)
                sock.sendall(pl)
            sock.sendall(tx.end())
            res = read_reply(sock, tx)
        except OSError as e:
            res = e
    assert isinstance(res, wire.PeerRefused) and res.reason == "digest", f"the sender got {res!r}"
    assert_nothing_landed(p, conv.session)


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_connection_dropped_half_way_leaves_no_replica(kv_pair: Pair, how: Literal["fin", "rst"]) -> None:
    """The a -> b connection dropped in the middle of a block's payload: no replica on b (engine or store), b keeps serving."""
    p = kv_pair
    conv = Conversation(f"torn-{how}", chars=1500)
    imported0 = imported_blocks(p)
    f = p.proxy.arm(Fault("cut", conv.session, block=4, byte=p.facts["a"].block_bytes // 2, how=how))
    with p.events("a") as ev_a, p.events("b") as ev_b:
        t = p.turn("a", conv)
        n = t.prompt_tokens // BLOCK
        refused = ev_b.wait_live(ReplicaRefused, session=conv.session)
        ev_a.wait_live(ReplicaRefused, session=conv.session)
        assert f.fired.is_set() and "bytes_delivered" in f.info, f"the proxy did not cut the connection: {f.info}"
        assert refused.reason == {"fin": "truncated", "rst": "connection"}[how], refused
        assert ev_b.live(ReplicaReady, session=conv.session) == []
        assert imported_blocks(p) == imported0
        assert_nothing_landed(p, conv.session)
        r = p.admin("a", f"/v1/admin/sessions/{conv.session}/replicate")
        assert r.status_code == 200 and r.json()["ok"], r.text
        ready = ev_b.wait_live(ReplicaReady, session=conv.session)
    assert ready.blocks == n, f"b kept {n - ready.blocks} blocks of the torn transfer"
    # Now b's engine has the blocks: another session with the same tokens finds them by hash.
    assert p.turn("b", conv.twin(f"torn-{how}-probe")).cached == n * BLOCK


def test_sender_gone_after_some_whole_blocks_leaves_no_replica(kv_pair: Pair) -> None:
    """A sender that disappears after 3 of 8 whole blocks (no END) leaves no replica; the resend starts from block 0."""
    p = kv_pair
    conv = Conversation("torn-hand", chars=8 * BLOCK)
    ho = hand_offer(p.facts["b"], conv.session, conv.tokens())
    n = ho.offer.n_blocks
    with p.events("b") as ev_b:
        assert hand_send(p.kv["b"], p.secret, ho, stop_after=3) == "cut"
        refused = ev_b.wait_live(ReplicaRefused, session=conv.session)
        assert refused.reason == "truncated", refused
        assert_nothing_landed(p, conv.session)
        # The resend is asked for every block (b kept nothing of the torn one) and lands.
        res = hand_send(p.kv["b"], p.secret, ho)
        assert res == wire.Completed(n * BLOCK), res
        ready = ev_b.wait_live(ReplicaReady, session=conv.session)
        assert ready.blocks == n, f"b asked for {ready.blocks} of {n} blocks: it kept some of the torn transfer"
    assert p.turn("b", conv).cached == n * BLOCK


# ---- malformed input on the listener ------------------------------------------------------------------------


def _connect(addr: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Read until the listener closes the connection; returns what it sent (fails on a hang)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the listener kept the connection open for {timeout:g}s")
    return got


def _refusal(addr: str, frame: bytes, secret: bytes) -> wire.SenderEvent | str:
    """Send a raw frame; decode the listener's reply (its reason; the signature is not checked here)."""
    tx = wire.Sender(secret)
    dummy = wire.Offer(session="x", sender="x", fingerprint="x", block_size=1, block_bytes=1, n_blocks=0, generation=0,
                       sent_at=0.0)
    tx.offer_bytes(dummy, [], [])  # only so that tx decodes an ANSWER
    with _connect(addr) as sock:
        sock.sendall(frame)
        return read_reply(sock, tx)


def _signed_offer(secret: bytes, header: bytes, tokens: np.ndarray, hashes: list[bytes]) -> bytes:
    body = struct.pack("<4sBBIII", wire.MAGIC, wire.VERSION, wire.Kind.OFFER, len(header), len(tokens), len(hashes))
    body += header + np.ascontiguousarray(tokens, dtype="<i4").tobytes() + b"".join(hashes)
    return body + hmac.new(secret, body, hashlib.sha256).digest()


def test_garbage_truncated_oversized_and_malformed_offers_are_refused_and_the_listener_keeps_serving(kv_pair: Pair) -> None:
    """Garbage, a truncated offer, huge claimed sizes and malformed headers are refused or closed; b keeps serving."""
    p = kv_pair
    addr, secret = p.kv["b"], p.secret.encode()
    facts = p.facts["b"]
    conv = Conversation("malformed-ok", chars=5 * BLOCK)
    good = hand_offer(facts, conv.session, conv.tokens())
    n = good.offer.n_blocks
    before = {r: p.refused_in("b", r) for r in ("oversized", "malformed", "fingerprint", "shape", "hash_chain")}
    imported0 = imported_blocks(p)

    # Garbage: closed without a reply.
    with _connect(addr) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: kvmesh\r\n\r\n")
        assert _closed_by_peer(s) == b""
    # A truncated offer (the sender closes half-way through it): closed.
    frame = wire.Sender(secret).offer_bytes(good.offer, good.tokens, good.hashes)
    with _connect(addr) as s:
        s.sendall(frame[: len(frame) // 2])
        s.shutdown(socket.SHUT_WR)
        assert _closed_by_peer(s) == b""
    # Huge sizes claimed in the 18-byte prefix: refused at once, before any body is read.
    for header_len, n_tokens, n_hashes in ((1 << 30, 64, 1), (100, 1 << 30, 1), (100, 64, 1 << 30)):
        prefix = struct.pack("<4sBBIII", wire.MAGIC, wire.VERSION, wire.Kind.OFFER, header_len, n_tokens, n_hashes)
        res = _refusal(addr, prefix, secret)
        assert isinstance(res, wire.PeerRefused) and res.reason == "oversized", (header_len, n_tokens, n_hashes, res)

    def header(**kw: object) -> bytes:
        return good.offer.model_copy(update={"session": "malformed-bad", **kw}).model_dump_json().encode()

    toks, hashes = good.tokens[:BLOCK], good.hashes[:1]
    cases = {
        # Signed, but the header claims 2**30 blocks while the frame carries one.
        "malformed": _signed_offer(secret, header(n_blocks=1 << 30), toks, hashes),
        "fingerprint": _signed_offer(secret, header(fingerprint="another-model", n_blocks=1), toks, hashes),
        "shape": _signed_offer(secret, header(block_bytes=facts.block_bytes * 2, n_blocks=1), toks, hashes),
        "hash_chain": _signed_offer(secret, header(n_blocks=1), toks,
                                    block_hashes(chain_seed(facts.fingerprint), toks[::-1].copy(), BLOCK)),
    }
    for reason, frame_ in cases.items():
        res = _refusal(addr, frame_, secret)
        assert isinstance(res, wire.PeerRefused) and res.reason == reason, (reason, res)
    # A session id with a control character is not an id ("../escape" alone is one: stored under its key).
    res = _refusal(addr, _signed_offer(secret, header(session="\x00../escape", n_blocks=1), toks, hashes), secret)
    assert isinstance(res, wire.PeerRefused) and res.reason == "malformed", res
    assert not (p.store_dir("b").parent / "escape").exists()

    # A stalled offer (half sent, connection kept open) does not stop the listener: a valid transfer lands meanwhile.
    with _connect(addr) as stalled, p.events("b") as ev_b:
        stalled.sendall(frame[:40])
        t0 = time.monotonic()
        assert hand_send(addr, secret, good) == wire.Completed(n * BLOCK)
        assert time.monotonic() - t0 < 10
        ready = ev_b.wait_live(ReplicaReady, session=conv.session)
    assert ready.blocks == n
    after = {r: p.refused_in("b", r) for r in before}
    assert after == {"oversized": before["oversized"] + 3, "malformed": before["malformed"] + 2,
                     "fingerprint": before["fingerprint"] + 1, "shape": before["shape"] + 1,
                     "hash_chain": before["hash_chain"] + 1}, after
    assert imported_blocks(p) == imported0 + n
    assert_nothing_landed(p, "malformed-bad")
    assert p.http.get(p.api("b") + "/health").json()["status"] == "ok"
    assert p.turn("b", conv).cached == n * BLOCK
