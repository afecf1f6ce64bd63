"""A handoff that reuses less than predicted says why: one `shortfall` reason per Handoff event, counted
per reason in /v1/stats, /v1/cluster and /metrics.

Real node processes (sim engine): `a` and `b`, with a's kv_share link to b through the chaos
`LinkProxy` (pass-through unless a test throttles it or arms a fault on it). b's KV pool and replica
store are small, so a few replicas push an older one out of both. The `none` and `prompt_diverged`
handoffs are placed by the mesh (a migration makes b the home, a turn through a's API goes there);
the others run on b the way a turn an entry forwarded does (the peer headers, with the previous host
and the reuse the entry predicted), since only an entry's stale view predicts a replica b no longer has
(or never got), and that view is what the test sets. The kv_share wait decision's arithmetic is
unit-tested at the top.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support.conversation import Conversation, Turn
from support.events import EventStream

from kvmesh.node.lab.chaos.proxy import Fault, LinkProxy
from kvmesh.node.kvshare.imports import keep_waiting
from kvmesh.node.kvshare.landing import _Inbound
from kvmesh.node.lab.launcher import free_port, wait_for, write_mesh
from kvmesh.node.lab.workload import text
from kvmesh.node.protocol import Handoff, ReplicaRefused

from .helpers import MODEL, POLL_S, SIM, STALE_S, Mesh, whole_blocks

TOKENS = 8000  # a session's opening (one token per character): ~3.2 MB of sim KV
B_CACHE = 16 << 20  # b's KV pool: four such sessions
B_STORE = 12 << 20  # b's replica store: three


# ---- the wait decision (no mesh) ---------------------------------------------------------------------


def test_a_turn_waits_for_a_landing_replica_only_while_it_beats_recompute() -> None:
    """The rest of a landing replica is timed at its observed rate and waited for only if that beats recomputing
    all it brings (it is usable only once whole)."""
    ib = _Inbound("a", tokens=10_000, started=100.0, eta_s=0.5, held=2_000, landed=2_000)
    at_stake = ib.tokens - ib.held  # 8,000 tokens: none usable before the replica's end
    assert ib.rest_s(100.2) == pytest.approx(0.3)  # nothing landed yet: the estimate made at the offer
    assert ib.rest_s(103.0) == pytest.approx(3.0)  # ...long overdue: as long again as it has taken
    assert not keep_waiting(ib.rest_s(103.0), at_stake, prefill_tps=4_000)  # recompute: 2 s
    ib.t_first, ib.landed = 100.0, 6_000  # 4,000 tokens in 1 s: the other 4,000 take 1 s more
    assert ib.rest_s(101.0) == pytest.approx(1.0)
    # Recomputing the 4,000 tokens still on the wire would take as long as waiting, but running now
    # loses all 8,000 the replica brings (2 s): wait.
    assert keep_waiting(ib.rest_s(101.0), at_stake, prefill_tps=4_000)
    assert not keep_waiting(ib.rest_s(101.0), at_stake, prefill_tps=16_000)  # recompute: 0.5 s
    assert not keep_waiting(0.0, 0, prefill_tps=1.0)  # nothing left to land


# ---- the mesh ---------------------------------------------------------------------------------------


class Pair(Mesh):
    """Nodes a and b (Mesh's clients and views), a's replicas to b through `proxy`, events from b."""

    proxy: LinkProxy
    b_events: EventStream


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    names = ["a", "b"]
    ports = {n: (free_port(), free_port()) for n in names}
    proxy = LinkProxy("a", "b", target=("127.0.0.1", ports["b"][1]))
    admin_token, secret = "adm-" + secrets.token_hex(12), "msk-" + secrets.token_hex(16)
    engine = {"kind": "sim", "slots": 2, "cache_bytes": 64 << 20, "queue_max": 8, "sim": dict(SIM)}
    base = write_mesh(
        tmp_path_factory.mktemp("shortfall"), names, ports=ports, routes={("a", "b"): proxy.address}, engine=engine,
        extra={"admin_token": admin_token, "kvshare": {"replicate_min_tokens": 1024, "fsync": "never"},
               "mesh": {"secret": secret, "poll_interval_s": POLL_S, "stale_after_s": STALE_S}},
        # b evicts what the test makes it evict: no host-memory tier keeps a copy there
        overrides={"b": {"engine": {**engine, "cache_bytes": B_CACHE},
                         "kvshare": {"store_budget_bytes": B_STORE, "host_tier_bytes": 0}}})
    m = Pair(base.workdir, base.nodes, base.configs, admin_token, secret)
    m.proxy = proxy
    try:
        m.start()
        m.b_events = EventStream(m.api("b"))
    except BaseException:
        proxy.close()
        raise
    try:
        yield m
    finally:
        m.b_events.close()
        m.stop()
        proxy.close()


def forwarded_turn(m: Pair, conv: Conversation, host: str, *, prev: str, predicted: int,
                   best_held: int | None = None) -> Turn:
    """A turn of `conv` run on `host` as one an entry placed there (previous host and predicted reuse sent, and
    the most of the session one host held, if given)."""
    headers = {"X-Session-Id": conv.session, "X-Kvmesh-Forwarded": "1", "X-Kvmesh-Prev-Host": prev,
               "X-Kvmesh-Predicted-Reuse": str(predicted), **m.peer_headers()}
    if best_held is not None:
        headers["X-Kvmesh-Best-Held"] = str(best_held)
    r = m.http.post(m.api(host) + "/v1/chat/completions", headers=headers,
                    json={"model": MODEL, "messages": conv.messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    t = Turn.answered(r.headers, prompt_tokens=body["usage"]["prompt_tokens"], session=conv.session,
                      reply=body["choices"][0]["message"]["content"] or "")
    assert t.host == host
    conv.turns.append(t)
    conv.grow(t.reply)
    return t


def first_turn_on_a(m: Pair, sid: str, tokens: int = TOKENS) -> tuple[Conversation, Turn]:
    """A new session's first turn, run on a (a then replicates it to b, its only peer)."""
    conv = Conversation(sid, chars=tokens)
    headers = {"X-Session-Id": sid, "X-Kvmesh-Forwarded": "1", **m.peer_headers()}
    r = m.http.post(m.api("a") + "/v1/chat/completions", headers=headers,
                    json={"model": MODEL, "messages": conv.messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    t = Turn.answered(r.headers, prompt_tokens=body["usage"]["prompt_tokens"], session=sid,
                      reply=body["choices"][0]["message"]["content"] or "")
    conv.turns.append(t)
    conv.grow(t.reply)
    return conv, t


def held_on_b(m: Pair, sid: str) -> dict[str, Any]:
    return m.holding("b", sid)


def wait_landed_on_b(m: Pair, sid: str, tokens: int) -> None:
    wait_for(lambda: held_on_b(m, sid).get("store_tokens", 0) >= tokens, f"b to store a replica of {sid} ({tokens})")


def shortfall_counts(m: Pair, host: str) -> dict[str, int]:
    return dict(m.stats(host)["handoffs"].get("shortfall", {}))


def handoff_on_b(m: Pair, sid: str) -> Handoff:
    return m.b_events.wait_live(Handoff, f"b's handoff of {sid}", session=sid)


def assert_counted(m: Pair, reason: str, before: dict[str, int]) -> None:
    """b's /v1/stats counted one more handoff of `reason`, and the cluster view (from a) has it too."""
    after = shortfall_counts(m, "b")
    assert after.get(reason, 0) == before.get(reason, 0) + 1, (reason, before, after)
    wait_for(lambda: m.cluster("a")["counters"]["shortfall"].get(reason, 0) >= after[reason],
             f"a's cluster view to count b's {reason} handoffs")


def migrate_to_b(m: Pair, sid: str) -> None:
    r = m.admin("a", f"/v1/admin/sessions/{sid}/migrate", {"target": "b"})
    assert r.status_code == 200 and r.json()["ok"], r.text
    m.wait_home(sid, "b", entries=["a"])


# ---- one test per reason --------------------------------------------------------------------------


def test_a_warm_move_has_no_shortfall(pair: Pair) -> None:
    """A session migrated with its replica reuses what placement predicted: shortfall none, counted as such."""
    m, before = pair, shortfall_counts(pair, "b")
    conv, t1 = first_turn_on_a(m, "sf-none")
    migrate_to_b(m, conv.session)
    t2 = m.turn(conv, "a")
    assert t2.host == "b" and t2.handoff == "warm", t2
    ev = handoff_on_b(m, conv.session)
    assert ev.shortfall == "none" and ev.predicted_reused_tokens is not None, ev
    assert ev.reused_tokens >= whole_blocks(ev.predicted_reused_tokens), ev
    assert ev.inflight_landed_tokens is None and ev.refused_reason is None and ev.evicted_from is None
    assert_counted(m, "none", before)
    fams = m.http.get(m.api("b") + "/metrics").text
    assert 'kvmesh_handoff_shortfall_total{reason="none"}' in fams


def test_a_rewritten_earlier_message_is_prompt_diverged(pair: Pair) -> None:
    """The client rewrote an earlier message after the replica moved: prompt_diverged, at that token and message."""
    m, before = pair, shortfall_counts(pair, "b")
    conv, t1 = first_turn_on_a(m, "sf-diverged")
    migrate_to_b(m, conv.session)
    at = 4000  # a character (token) of the system prompt, well inside what the replica holds
    old = conv.tokens()
    sys_text = conv.messages[0]["content"]
    conv.messages[0]["content"] = sys_text[:at] + "REWRITTEN" + sys_text[at + 9:]  # context compaction, say
    first_diff = int(np.flatnonzero(conv.tokens() != old)[0])  # same length: 9 characters for 9
    t2 = m.turn(conv, "a")
    assert t2.host == "b", t2
    ev = handoff_on_b(m, conv.session)
    assert ev.shortfall == "prompt_diverged", ev
    assert ev.mismatch_token == first_diff and ev.mismatch_message == 0, ev
    assert ev.predicted_reused_tokens is not None, ev
    assert ev.reused_tokens <= first_diff < whole_blocks(ev.predicted_reused_tokens), ev
    assert_counted(m, "prompt_diverged", before)


def test_a_turn_that_runs_while_its_replica_lands_is_replica_in_flight(pair: Pair) -> None:
    """A replica crawling over a slow link, slower than b recomputes: the turn runs without it, replica_in_flight."""
    m, before = pair, shortfall_counts(pair, "b")
    sid = "sf-inflight"
    # ~1.2 MB/s: 3,000 tokens/s of sim KV, against b's 20,000 tokens/s prefill: recomputing is quicker.
    slow = m.proxy.arm(Fault("watch", session=sid, rate_bps=1.2e6))
    try:
        conv, t1 = first_turn_on_a(m, sid, tokens=12_000)
        landing = wait_for(lambda: (h := held_on_b(m, sid)).get("inbound_tokens", 0) > 0
                           and 0 < h.get("inbound_landed", 0) < h["inbound_tokens"] and h,
                           f"b to report a replica of {sid} partly landed")
        offered = landing["inbound_tokens"]
        t2 = forwarded_turn(m, conv, "b", prev="a", predicted=offered)
        ev = handoff_on_b(m, sid)
    finally:
        slow.rate_bps = None  # let the rest land at once
    assert ev.shortfall == "replica_in_flight", ev
    assert ev.inflight_offered_tokens == offered, ev
    assert ev.inflight_landed_tokens is not None and 0 < ev.inflight_landed_tokens < offered, ev
    assert t2.cached == ev.reused_tokens < offered
    assert_counted(m, "replica_in_flight", before)


def test_a_replica_this_host_refused_is_replica_refused(pair: Pair) -> None:
    """b refused the session's replica (a bit flipped on the way fails its digest): replica_refused, with the reason."""
    m, before = pair, shortfall_counts(pair, "b")
    sid = "sf-refused"
    flip = m.proxy.arm(Fault("flip", session=sid))
    conv, t1 = first_turn_on_a(m, sid)
    refused = m.b_events.wait_live(ReplicaRefused, f"b to refuse the replica of {sid}", session=sid)
    assert flip.fired.is_set()
    t2 = forwarded_turn(m, conv, "b", prev="a", predicted=whole_blocks(t1.prompt_tokens))
    ev = handoff_on_b(m, sid)
    assert ev.shortfall == "replica_refused" and ev.refused_reason == refused.reason == "digest", ev
    assert t2.cached == 0
    assert_counted(m, "replica_refused", before)


def test_a_replica_this_host_evicted_is_evicted(pair: Pair) -> None:
    """b held the session's replica, then newer replicas pushed it out of its pool and store: evicted."""
    m, before = pair, shortfall_counts(pair, "b")
    conv, t1 = first_turn_on_a(m, "sf-evicted")
    wait_landed_on_b(m, conv.session, whole_blocks(t1.prompt_tokens))
    for i in range(8):  # each filler's replica lands on b; b's pool and store hold about three or four
        h = held_on_b(m, conv.session)
        if not h.get("resident_tokens") and not h.get("store_tokens"):
            break
        filler, ft = first_turn_on_a(m, f"sf-evicted-filler-{i}")
        wait_landed_on_b(m, filler.session, whole_blocks(ft.prompt_tokens))
    else:
        pytest.fail(f"b still holds {conv.session}: {held_on_b(m, conv.session)}")
    t2 = forwarded_turn(m, conv, "b", prev="a", predicted=whole_blocks(t1.prompt_tokens))
    ev = handoff_on_b(m, conv.session)
    assert ev.shortfall == "evicted" and ev.evicted_from in ("engine", "store"), ev
    assert t2.cached == 0
    assert_counted(m, "evicted", before)


def grow_by(conv: Conversation, tokens: int) -> None:
    """The client adds `tokens` of new input (a long tool output, one token per character) to its next turn."""
    conv.messages.append({"role": "user", "content": text(conv.rng, tokens)})


def test_a_move_with_much_new_input_is_new_input(pair: Pair) -> None:
    """A move that reuses the whole replica, with more than a tenth of its prompt new, names new_input."""
    m, before = pair, shortfall_counts(pair, "b")
    conv, t1 = first_turn_on_a(m, "sf-new-input")
    migrate_to_b(m, conv.session)
    held = held_on_b(m, conv.session)
    grow_by(conv, conv.prompt_len() // 2)  # a third of the next prompt is new: nobody held it
    t2 = m.turn(conv, "a")
    assert t2.host == "b" and t2.handoff == "partial", t2
    ev = handoff_on_b(m, conv.session)
    assert ev.shortfall == "new_input", ev
    assert ev.predicted_reused_tokens is not None and ev.reused_tokens >= whole_blocks(ev.predicted_reused_tokens), ev
    assert ev.reused_tokens >= whole_blocks(max(held.get("resident_tokens", 0), held.get("store_tokens", 0))), (ev, held)
    assert_counted(m, "new_input", before)


def test_a_move_onto_an_older_replica_is_replica_behind(pair: Pair) -> None:
    """The entry saw another host hold a warm share of the prompt and b only an older replica: b reuses what it
    was predicted to, and the handoff names replica_behind."""
    m, before = pair, shortfall_counts(pair, "b")
    conv, t1 = first_turn_on_a(m, "sf-behind")
    stored = whole_blocks(t1.prompt_tokens)
    wait_landed_on_b(m, conv.session, stored)
    grow_by(conv, conv.prompt_len() // 2)
    # What a's engine would hold after a turn b never got a replica of: all of this prompt but its last block.
    best = conv.prompt_len() - 1
    t2 = forwarded_turn(m, conv, "b", prev="a", predicted=stored, best_held=best)
    ev = handoff_on_b(m, conv.session)
    assert ev.shortfall == "replica_behind" and ev.cls == "partial", ev
    assert t2.cached == ev.reused_tokens >= stored, ev
    assert_counted(m, "replica_behind", before)
    # The same view without what the other hosts held (an entry that did not say): the reason stays none.
    grow_by(conv, conv.prompt_len() // 2)
    t3 = forwarded_turn(m, conv, "b", prev="a", predicted=whole_blocks(t2.prompt_tokens))
    ev3 = m.b_events.wait_live(Handoff, f"b's third handoff of {conv.session}", session=conv.session,
                               prompt_tokens=t3.prompt_tokens)
    assert ev3.cls == "partial" and ev3.shortfall == "none", ev3
