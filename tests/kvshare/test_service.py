"""kv_share as a service, between real node processes on loopback: delta replicas over growing turns,
supersede, restart with replicas on disk, eviction then re-import (the field report's v2.11.1 lesson), and
the store-only landing when the receiving engine has no room.

Turns are pinned to a node (peer-forwarded, see service_helpers), so every test says where each turn runs;
a's replicas to b cross a proxy (pass-through unless a test pauses it).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import TypeVar

import pytest
from pydantic import BaseModel
from support.conversation import Conversation
from support.events import EventStream

from kvmesh.node.kvshare import wire
from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.protocol import (
    ReplicaImported,
    ReplicaReady,
    ReplicaRefused,
    ReplicaSent,
    ReplicaStarted,
    ReplicaSuperseded,
    session_key,
)

from .service_helpers import (
    BLOCK,
    Pair,
    engine_cfg,
    engine_facts,
    hand_offer,
    hand_send,
    read_reply,
    start_pair,
)

E = TypeVar("E", bound=BaseModel)

# Framing of one transfer (node/kvshare/wire): OFFER prefix 18 B + header JSON + 4 B per token + 16 B per hash
# + 32 B mac; 37 B before each block's payload; END 37 B.
PREFIX, MAC, BLOCK_HDR, END = 18, 32, 37, 37


def offer_json_bounds(pair: Pair, session: str, n_blocks: int) -> tuple[int, int]:
    """Smallest and largest header JSON a's offer of n_blocks can have (generation and sent_at vary)."""
    f = pair.facts["a"]
    base = wire.Offer(session=session, sender="a", fingerprint=f.fingerprint, block_size=BLOCK, block_bytes=f.block_bytes,
                      n_blocks=n_blocks, generation=0, sent_at=0.0).model_dump_json()
    return len(base), len(base) + 40


def transfer_bytes(pair: Pair, session: str, n_blocks: int, sent_blocks: int) -> tuple[int, int]:
    """Bounds on the bytes b receives for a's offer of n_blocks of which sent_blocks cross the wire."""
    lo, hi = offer_json_bounds(pair, session, n_blocks)
    fixed = PREFIX + 4 * n_blocks * BLOCK + 16 * n_blocks + MAC + sent_blocks * (BLOCK_HDR + pair.facts["a"].block_bytes) + END
    return fixed + lo, fixed + hi


def nth_event(stream: EventStream, kind: type[E], session: str, k: int) -> E:
    """The k-th (from 0) live event of this kind for the session, once it has arrived."""
    def get() -> E | None:
        evs = stream.live(kind, session=session)
        return evs[k] if len(evs) > k else None
    return wait_for(get, f"{kind.__name__} #{k + 1} of {session}")


def wait_store(p: Pair, session: str, tokens: int) -> None:
    wait_for(lambda: p.holding("b", session)["store_tokens"] == tokens, f"b's store to hold {tokens} tokens of {session}")


def test_delta_replicas_over_growing_turns_carry_only_new_whole_blocks(kv_pair: Pair) -> None:
    """Each turn's replica carries only the new whole blocks; b's engine then holds exactly the whole-block prefix."""
    p = kv_pair
    conv = Conversation("delta-1", chars=1500)
    # Prompt sizes of turns 2..4 (turn 1: whatever 1500 characters make): 40 blocks + 10, the same 40 blocks
    # + 50 (a turn that adds no whole block), 61 blocks + 5.
    sizes = [40 * BLOCK + 10, 40 * BLOCK + 50, 61 * BLOCK + 5]
    held = 0  # whole blocks b holds
    with p.events("a") as ev_a, p.events("b") as ev_b:
        for k in range(4):
            t = p.turn("a", conv)
            n = t.prompt_tokens // BLOCK
            ready = nth_event(ev_b, ReplicaReady, conv.session, k)
            sent = nth_event(ev_a, ReplicaSent, conv.session, k)
            assert ready.src == "a" and ready.imported is True
            assert ready.tokens == n * BLOCK, f"turn {k + 1}: {ready}"
            assert ready.blocks == n - held, f"turn {k + 1}: {n - held} new whole blocks, {ready.blocks} sent"
            lo, hi = transfer_bytes(p, conv.session, n, n - held)
            assert lo <= ready.bytes <= hi, f"turn {k + 1}: {ready.bytes} bytes on the wire, expected {lo}..{hi}"
            assert (sent.bytes, sent.blocks, sent.tokens) == (ready.bytes, ready.blocks, n * BLOCK)
            if k == 2:
                assert ready.blocks == 0, "a turn that adds no whole block sent blocks"
            # b's engine holds the whole-block prefix (asked of b itself), and its store catches up.
            assert p.holding("b", conv.session)["resident_tokens"] == n * BLOCK
            wait_store(p, conv.session, n * BLOCK)
            assert len(ev_b.live(ReplicaReady, session=conv.session)) == k + 1
            held = n
            if k < 3:
                conv.grow_to(t.reply, sizes[k])
    # The session moves to b: exactly the replica's whole blocks are reused there.
    conv.grow_to(t.reply, held * BLOCK + 5 + 40)
    t = p.turn("b", conv, prev_host="a")
    assert t.cached == held * BLOCK, f"{t.cached} tokens reused on b; the replica holds {held * BLOCK}"
    assert t.handoff == "warm"


def test_newer_replica_supersedes_one_in_flight(kv_pair: Pair) -> None:
    """A newer replica for the same (session, target) supersedes a stalled one in flight; one transfer at a time;
    the newest lands."""
    p = kv_pair
    conv = Conversation("supersede-1", chars=2000)
    before = p.stats("a")["kvshare"]["out"].get("b", {}).get("superseded", 0)
    p.proxy.reset_counts()
    with p.events("a") as ev_a, p.events("b") as ev_b:
        p.proxy.pause()  # the first push connects, then stalls in the proxy
        try:
            t1 = p.turn("a", conv)
            wait_for(lambda: p.proxy.connections >= 1, "the first push to connect")
            conv.grow_to(t1.reply, t1.prompt_tokens + 10 * BLOCK)
            t2 = p.turn("a", conv)
            ev_a.wait_live(ReplicaSuperseded, session=conv.session, dst="b")
        finally:
            p.proxy.resume()
        n1, n2 = t1.prompt_tokens // BLOCK, t2.prompt_tokens // BLOCK
        ready = ev_b.wait_live(ReplicaReady, session=conv.session, tokens=n2 * BLOCK)
        sent = ev_a.wait_live(ReplicaSent, session=conv.session, tokens=n2 * BLOCK)
        assert ready.blocks == n2, "the superseded replica landed nothing, so the newest carries every block"
        assert sent.blocks == n2
        assert [r.tokens for r in ev_b.live(ReplicaReady, session=conv.session)] == [n2 * BLOCK], \
            f"the superseded replica ({n1} blocks) must not become ready"
        assert [s.tokens for s in ev_a.live(ReplicaSent, session=conv.session)] == [n2 * BLOCK]
    assert p.stats("a")["kvshare"]["out"]["b"]["superseded"] == before + 1
    # The sender closes a superseded transfer's socket at once; the paused proxy only notices when it
    # resumes, so it may count the two connections as briefly overlapping (never more than two).
    assert p.proxy.connections == 2 and p.proxy.max_active <= 2, "more than two transfers of one (session, target)"
    assert p.holding("b", conv.session)["resident_tokens"] == n2 * BLOCK
    wait_for(lambda: p.holding("b", conv.session)["store_tokens"] == n2 * BLOCK, "b's store to hold the newest replica")
    assert p.temp_files("b") == []


def test_a_progressing_transfer_finishes_and_the_newer_replica_sends_only_the_delta(kv_pair: Pair) -> None:
    """On a slow link a newer turn does not restart a transfer that is still moving bytes: it lands, and the
    newer replica follows with only the blocks after it (restarting would starve the link: nothing lands)."""
    p = kv_pair
    conv = Conversation("slow-link-1", chars=6000)
    before = p.stats("a")["kvshare"]["out"].get("b", {}).get("superseded", 0)
    p.proxy.reset_counts()
    p.proxy.rate_bps = 1e6  # ~2.5 s for the first replica
    try:
        with p.events("a") as ev_a, p.events("b") as ev_b:
            t1 = p.turn("a", conv)
            wait_for(lambda: p.proxy.connections >= 1, "the first push to connect")
            conv.grow_to(t1.reply, t1.prompt_tokens + 10 * BLOCK)
            t2 = p.turn("a", conv)
            n1, n2 = t1.prompt_tokens // BLOCK, t2.prompt_tokens // BLOCK
            first = ev_b.wait_live(ReplicaReady, session=conv.session, tokens=n1 * BLOCK)
            second = ev_b.wait_live(ReplicaReady, session=conv.session, tokens=n2 * BLOCK)
            assert not ev_a.live(ReplicaSuperseded, session=conv.session)
            ev_a.wait_live(ReplicaSent, session=conv.session, tokens=n2 * BLOCK)
            # a's own event order: the second push began only once the first was sent. (Counting the
            # proxy's open connections races with the first one's closing handshake.)
            order = [(type(e).__name__, e.tokens) for e in ev_a.received()
                     if isinstance(e, (ReplicaStarted, ReplicaSent)) and e.session == conv.session]
    finally:
        p.proxy.rate_bps = None
    assert first.blocks == n1 and second.blocks == n2 - n1, (first, second)
    assert p.stats("a")["kvshare"]["out"]["b"]["superseded"] == before
    assert p.proxy.connections == 2, "one connection per transfer"
    assert order == [("ReplicaStarted", n1 * BLOCK), ("ReplicaSent", n1 * BLOCK),
                     ("ReplicaStarted", n2 * BLOCK), ("ReplicaSent", n2 * BLOCK)], f"the transfers overlapped: {order}"


def test_superseded_counts_each_replica_once(kv_pair: Pair) -> None:
    """Three quick pushes of one (session, target) while the first stalls: the queued second gives way to the
    third, the stalled first to the third too; two replicas superseded, counted and announced once each."""
    p = kv_pair
    conv = Conversation("supersede-3", chars=1200)
    before = p.stats("a")["kvshare"]["out"].get("b", {}).get("superseded", 0)
    before_in_flight = p.stats("a")["kvshare"]["out"].get("b", {}).get("superseded_in_flight", 0)
    p.proxy.reset_counts()
    with p.events("a") as ev_a, p.events("b") as ev_b:
        p.proxy.pause()
        try:
            t = p.turn("a", conv)
            wait_for(lambda: p.proxy.connections >= 1, "the first push to connect")
            for _ in range(2):
                conv.grow_to(t.reply, t.prompt_tokens + 3 * BLOCK)
                t = p.turn("a", conv)
            wait_for(lambda: len(ev_a.live(ReplicaSuperseded, session=conv.session)) >= 2,
                     "the stalled transfer to be superseded")
        finally:
            p.proxy.resume()
        n = t.prompt_tokens // BLOCK
        ev_b.wait_live(ReplicaReady, session=conv.session, tokens=n * BLOCK)
        superseded = ev_a.live(ReplicaSuperseded, session=conv.session)
    assert p.stats("a")["kvshare"]["out"]["b"]["superseded"] - before == 2
    # The queued second gave way to the third; the stalled first was replaced in flight.
    assert p.stats("a")["kvshare"]["out"]["b"]["superseded_in_flight"] - before_in_flight == 1
    assert len(superseded) == 2, f"{len(superseded)} replica_superseded events for 2 superseded replicas"


def test_replica_on_disk_survives_a_restart_and_is_imported_before_the_turn(kv_pair: Pair) -> None:
    """b restarts with a replica in its store: the session's next turn on b is warm, imported from the store first."""
    p = kv_pair
    conv = Conversation("restart-1", chars=1800)
    with p.events("b") as ev_b:
        t = p.turn("a", conv)
        n = t.prompt_tokens // BLOCK
        ev_b.wait_live(ReplicaReady, session=conv.session, tokens=n * BLOCK)
    wait_for(lambda: p.holding("b", conv.session)["store_tokens"] == n * BLOCK, "b's store to hold the replica")
    assert (p.store_dir("b") / session_key(conv.session) / "manifest.json").is_file()
    p.restart("b")
    held = p.holding("b", conv.session)
    assert held["resident_tokens"] == 0, "a fresh engine holds nothing"
    assert held["store_tokens"] == n * BLOCK, f"the restarted store does not index the replica: {held}"
    conv.grow_to(t.reply, t.prompt_tokens + 30)
    with p.events("b") as ev_b:
        t2 = p.turn("b", conv, prev_host="a")
        imp = ev_b.wait_live(ReplicaImported, session=conv.session)
    assert t2.cached == n * BLOCK and t2.handoff == "warm", t2
    assert imp.host == "b" and imp.tokens == n * BLOCK
    assert p.temp_files("b") == []


# ---- a receiver with a small KV pool -------------------------------------------------------------------

POOL_BLOCKS = 40  # b's pool in the tight pair


def _tight(tmp_path_factory: pytest.TempPathFactory, tight: str) -> Iterator[Pair]:
    """A pair where node `tight` has a pool of only POOL_BLOCKS blocks and the other 64 MiB."""
    bb = engine_facts(engine_cfg()).block_bytes
    engines = {n: engine_cfg(cache_bytes=POOL_BLOCKS * bb) if n == tight else engine_cfg() for n in ("a", "b")}
    pair = start_pair(tmp_path_factory.mktemp(f"tight-{tight}"), engines=engines)
    try:
        yield pair
    finally:
        pair.proxy.resume()
        pair.stop()


@pytest.fixture(scope="module")
def tight_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """a (64 MiB pool) and b with a pool of only 40 blocks."""
    yield from _tight(tmp_path_factory, "b")


def test_evicted_replica_is_reimported_from_the_store_before_the_next_turn(tight_pair: Pair) -> None:
    """Replica imported, evicted by b's engine under memory pressure: the next turn on b is warm via re-import."""
    p = tight_pair
    conv = Conversation("evict-1", chars=1250)
    with p.events("a") as ev_a, p.events("b") as ev_b:
        t = p.turn("a", conv)
        n = t.prompt_tokens // BLOCK
        ready = ev_b.wait_live(ReplicaReady, session=conv.session)
        assert ready.imported is True and ready.tokens == n * BLOCK
        assert p.holding("b", conv.session)["resident_tokens"] == n * BLOCK
        wait_for(lambda: p.holding("b", conv.session)["store_tokens"] == n * BLOCK, "b's store to hold the replica")
        engine0 = p.stats("b")["engine"]

        # Memory pressure: another session, bigger than what is left of b's pool, runs on b itself.
        filler = Conversation("evict-filler", chars=(POOL_BLOCKS - n + 10) * BLOCK)
        p.turn("b", filler)
        assert p.holding("b", conv.session)["resident_tokens"] == 0, "b's engine did not evict the replica"
        assert p.stats("b")["engine"]["evicted_sessions"] > engine0["evicted_sessions"]
        assert p.holding("b", conv.session)["store_tokens"] == n * BLOCK
        # b pushes the filler on to a and keeps its own copy: wait until neither pins the filler's blocks.
        ev_a.wait_live(ReplicaReady, session=filler.session)
        ev_b.wait_live(ReplicaSent, session=filler.session)
        wait_for(lambda: p.holding("b", filler.session)["store_tokens"] > 0, "b to persist the filler")
        p.wait_quiet("b")

        conv.grow_to(t.reply, t.prompt_tokens + 40)
        t2 = p.turn("b", conv, prev_host="a")
        imp = ev_b.wait_live(ReplicaImported, session=conv.session)
    assert t2.cached == n * BLOCK, f"{t2.cached} tokens reused; the stored replica holds {n * BLOCK}"
    assert t2.handoff == "warm"
    assert imp.tokens == n * BLOCK
    engine1 = p.stats("b")["engine"]
    assert engine1["imported_blocks"] > engine0["imported_blocks"], "the turn was warm without an import"
    counters = p.stats("b")["handoffs"]
    assert counters["stale_state_cold"] == 0 and counters["cold"] == 0 and counters["warm"] >= 1, counters


def test_delta_to_a_receiver_whose_engine_evicted_the_replica_carries_only_new_blocks(tight_pair: Pair) -> None:
    """b's engine evicted the replica but its store kept it: the next delta carries only new blocks and b's engine
    is refilled from its store, so the session is resident whole again."""
    p = tight_pair
    p.wait_quiet("b")
    conv = Conversation("evict-delta", chars=1000)
    with p.events("a") as ev_a, p.events("b") as ev_b:
        t = p.turn("a", conv)
        n1 = t.prompt_tokens // BLOCK
        ev_b.wait_live(ReplicaReady, session=conv.session, tokens=n1 * BLOCK)
        wait_for(lambda: p.holding("b", conv.session)["store_tokens"] == n1 * BLOCK, "b's store to hold the replica")
        filler = Conversation("evict-delta-filler", chars=(POOL_BLOCKS - 2) * BLOCK - 20)
        p.turn("b", filler)
        assert p.holding("b", conv.session)["resident_tokens"] == 0, "b's engine did not evict the replica"
        ev_b.wait_live(ReplicaSent, session=filler.session)
        p.wait_quiet("b")
        imported0 = p.stats("b")["engine"]["imported_blocks"]

        conv.grow_to(t.reply, (n1 + 5) * BLOCK + 7)
        t2 = p.turn("a", conv)
        n2 = t2.prompt_tokens // BLOCK
        ready = ev_b.wait_live(ReplicaReady, session=conv.session, tokens=n2 * BLOCK)
        sent = ev_a.wait_live(ReplicaSent, session=conv.session, tokens=n2 * BLOCK)
    assert ready.blocks == sent.blocks == n2 - n1, f"{ready.blocks} blocks crossed; b's store held {n1} of {n2}"
    assert ready.imported is True
    assert p.holding("b", conv.session)["resident_tokens"] == n2 * BLOCK
    assert p.stats("b")["engine"]["imported_blocks"] - imported0 > n2 - n1, "no block was refilled from b's store"
    conv.grow_to(t2.reply, t2.prompt_tokens + 20)
    t3 = p.turn("b", conv, prev_host="a")
    assert t3.cached == n2 * BLOCK and t3.handoff == "warm", t3


def test_replica_lands_in_the_store_when_the_engine_has_no_room(tight_pair: Pair) -> None:
    """With every block of b's pool reserved, a replica lands in b's store only (a torn one leaves nothing), and
    is imported from there before the session's turn."""
    p = tight_pair
    p.wait_quiet("b")
    facts = p.facts["b"]
    hog = Conversation("noroom-hog", chars=POOL_BLOCKS * BLOCK + 20)
    conv = Conversation("noroom-x", chars=10 * BLOCK)
    hog_offer = hand_offer(facts, hog.session, hog.tokens()[: POOL_BLOCKS * BLOCK])
    x_offer = hand_offer(facts, conv.session, conv.tokens())
    n = x_offer.offer.n_blocks
    host, port = p.kv["b"].rsplit(":", 1)
    with p.events("b") as ev_b:
        # An accepted transfer of a whole pool's worth of blocks reserves every block of b's pool, then stalls.
        with socket.create_connection((host, int(port)), timeout=10) as hog_sock:
            tx = wire.Sender(p.secret.encode())
            hog_sock.sendall(tx.offer_bytes(hog_offer.offer, hog_offer.tokens, hog_offer.hashes))
            assert read_reply(hog_sock, tx) == wire.Accepted(0)

            # A torn store-only transfer: nothing is left behind.
            assert hand_send(p.kv["b"], p.secret, x_offer, stop_after=n // 2, half_payload=True) == "cut"
            ev_b.wait_live(ReplicaRefused, session=conv.session)
            assert not (p.store_dir("b") / session_key(conv.session)).exists()
            assert p.temp_files("b") == []

            # A whole one lands in the store (not in the engine: it has no room).
            res = hand_send(p.kv["b"], p.secret, x_offer)
            assert isinstance(res, wire.Completed), res
            ready = ev_b.wait_live(ReplicaReady, session=conv.session)
            assert ready.imported is False and ready.blocks == n
            held = p.holding("b", conv.session)
            assert held["resident_tokens"] == 0 and held["store_tokens"] == n * BLOCK, held
        # The stalled transfer is dropped: its reserved blocks go back.
        ev_b.wait_live(ReplicaRefused, session=hog.session)
        conv.grow_to("", conv.prompt_len() + 30)
        t = p.turn("b", conv, prev_host="a")
        imp = ev_b.wait_live(ReplicaImported, session=conv.session)
    assert t.cached == n * BLOCK and imp.tokens == n * BLOCK, (t, imp)
    assert p.holding("b", hog.session)["resident_tokens"] == 0
    assert not (p.store_dir("b") / session_key(hog.session)).exists()
    assert p.temp_files("b") == []


@pytest.fixture(scope="module")
def tight_sender(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """a with a pool of only 40 blocks (its pushes to b cross the proxy), b with 64 MiB."""
    yield from _tight(tmp_path_factory, "a")


def test_restore_preempts_a_push_that_pins_the_pool(tight_sender: Pair) -> None:
    """A push stalled on the wire pins most of a's pool; a turn on a that must restore a session from a's
    store stops that push (refused "preempted") instead of running cold, and the turn is warm."""
    p = tight_sender
    conv = Conversation("preempt-x", chars=10 * BLOCK)
    with p.events("a") as ev_a:
        t = p.turn("a", conv)
        n = t.prompt_tokens // BLOCK
        wait_for(lambda: p.holding("a", conv.session)["store_tokens"] == n * BLOCK, "a to persist its session")
        p.wait_quiet("a")
        p.proxy.pause()
        try:
            filler = Conversation("preempt-filler", chars=(POOL_BLOCKS - 4) * BLOCK)
            p.turn("a", filler)  # evicts conv from a's engine; its push to b stalls in the proxy
            assert p.holding("a", conv.session)["resident_tokens"] == 0, "a's engine did not evict the session"
            wait_for(lambda: p.holding("a", filler.session)["inflight_to"] == "b", "the filler's push to be in flight")
            conv.grow_to(t.reply, t.prompt_tokens + 30)
            t2 = p.turn("a", conv)
            refused = ev_a.wait_live(ReplicaRefused, session=filler.session)
        finally:
            p.proxy.resume()
    assert refused.reason == "preempted", refused
    assert t2.cached == n * BLOCK, f"{t2.cached} tokens reused; a's store held {n * BLOCK}"
    assert p.stats("a")["kvshare"]["out"]["b"]["refused"].get("preempted") == 1
