"""Admission (node.mesh.admission): which turns the mesh queues, moves or refuses, and the place a refused turn keeps."""

from __future__ import annotations

from kvmesh.node.mesh.admission import Admission, Refusal, Reservation, Reservations, admit, admit_turn
from kvmesh.node.mesh.placement import Decision, Holding, HostLoad, Policy, choose

PREFILL = 10_000.0
PROMPT = 20_000
POLICY = Policy(kv_bytes_per_token=1)
RULE = Admission(wait_s=10.0, new_wait_s=2.0, timeout_s=600.0)
HELD = {"a": Holding(resident=PROMPT, home_seq=1, turn_seq=1)}


def _busy(name: str, queued: int, mean_turn_s: float = 4.0) -> HostLoad:
    """Two slots, both busy, `queued` waiting: a turn placed there waits (queued + 1) x mean / 2."""
    return HostLoad(name, 2, 2, queued, mean_turn_s, PREFILL, 1e9)


def _place(hosts: dict[str, HostLoad], holdings: dict[str, Holding], **kw: object) -> Decision | Refusal:
    d = choose(hosts, holdings, PROMPT, POLICY, session="s")
    assert d is not None
    return admit(d, hosts, holdings, PROMPT, POLICY, RULE, session="s", **kw)  # type: ignore[arg-type]


def test_a_host_that_starts_the_turn_within_the_patience_is_kept() -> None:
    """The home has a free slot: the decision passes unchanged."""
    hosts = {"a": HostLoad("a", 2, 1, 0, 4.0, PREFILL, 1e9), "b": _busy("b", 0)}
    d = _place(hosts, HELD)
    assert isinstance(d, Decision) and d.host == "a" and d.reason == "home", d


def test_a_turn_that_would_start_within_its_clients_patience_is_queued_not_refused() -> None:
    """A 6 s wait against a running session's 10 s patience: queued (a refusal would only send it back to wait as long)."""
    hosts = {"a": _busy("a", 2), "b": _busy("b", 2)}
    d = _place(hosts, HELD)
    assert isinstance(d, Decision) and d.host == "a", d


def test_a_turn_past_its_patience_is_refused_with_a_place_until_the_queue_is_back_within_it() -> None:
    """A 14 s wait everywhere against 10 s: refused, back in the 4 s over, with its place in line kept there."""
    hosts = {"a": _busy("a", 6), "b": _busy("b", 6)}
    r = _place(hosts, HELD, now=100.0)
    assert isinstance(r, Refusal), r
    assert not r.new_session and r.bound_s == 10.0 and r.retry_after_s == 4.0, r
    # It will prefill what its home does not hold (one token: a turn always computes its last), counted there meanwhile.
    assert r.reserved == Reservation("a", 100.0, 104.0, 1), r
    assert "overloaded" in r.message() and "retry after 4 s" in r.message() and "place in line" in r.message()


def test_a_new_sessions_patience_is_its_own() -> None:
    """A 6 s wait everywhere: within a running session's 10 s, past a new session's 2 s."""
    hosts = {"a": _busy("a", 2), "b": _busy("b", 2)}
    new = _place(hosts, {})
    assert isinstance(new, Refusal) and new.new_session and new.bound_s == 2.0, new


def test_a_refused_turn_back_when_its_place_is_due_is_admitted_whatever_the_queue() -> None:
    """Its place is due at 104 s: back then (or a second early, as a rounded Retry-After may bring it) it is admitted
    onto a 42 s queue; back at 101 s it is refused again with the 3 s left, its place kept."""
    place = Reservation("a", 100.0, 104.0, 0)
    far = {"a": _busy("a", 20), "b": _busy("b", 20)}
    for now in (103.0, 104.0, 130.0):
        assert isinstance(_place(far, HELD, now=now, reservation=place), Decision), now
    early = _place(far, HELD, now=101.0, reservation=place)
    assert isinstance(early, Refusal) and early.retry_after_s == 3.0 and early.reserved == place, early


def test_turns_arriving_after_a_refused_one_count_its_place_ahead_of_them() -> None:
    """A 6 s wait is within the patience; with three places promised on that host ahead (two slots: 6 s more) it is not."""
    hosts = {"a": _busy("a", 2), "b": _busy("b", 2)}
    assert isinstance(_place(hosts, HELD), Decision)
    owed = {"a": (3, 0), "b": (3, 0)}
    assert isinstance(_place(hosts, HELD, reserved=owed), Refusal)


def test_a_turn_no_place_could_serve_is_queued_not_refused() -> None:
    """A 2,002 s wait: even back after a minute's Retry-After it would not start within its client's 600 s timeout, so
    a refusal could only fail it: it is queued at its home (where it may yet start as turns ahead give up)."""
    far = {"a": _busy("a", 1000), "b": _busy("b", 1000)}
    d = _place(far, HELD, now=0.0)
    assert isinstance(d, Decision) and d.host == "a", d
    edge = {"a": _busy("a", 329), "b": _busy("b", 329)}  # 660 s: back in 60 s, it starts at the timeout
    r = _place(edge, HELD)
    assert isinstance(r, Refusal) and r.retry_after_s == 60.0, r


def test_the_book_keeps_a_place_counts_it_on_its_host_and_gives_it_up_when_admitted() -> None:
    """admit_turn: a refusal's place goes in the book and counts on its host; the turn admitted, the place is gone; a
    place nobody claims lapses 30 s after it was due."""
    book = Reservations()
    far = {"a": _busy("a", 6), "b": _busy("b", 6)}
    d = choose(far, HELD, PROMPT, POLICY, session="s")
    assert d is not None
    r = admit_turn(book, "s", 100.0, d, far, HELD, PROMPT, POLICY, RULE)
    assert isinstance(r, Refusal) and book.get("s", 100.0) == r.reserved and book.per_host(100.0) == {"a": (1, 1)}
    assert isinstance(admit_turn(book, "s", 104.0, d, far, HELD, PROMPT, POLICY, RULE), Decision)
    assert book.get("s", 104.0) is None and book.per_host(104.0) == {}
    admit_turn(book, "t", 200.0, d, far, HELD, PROMPT, POLICY, RULE)
    assert len(book) == 1 and book.get("t", 235.0) is None and len(book) == 0


def test_an_overloaded_home_overflows_only_to_idle_capacity() -> None:
    """The home's wait is 14 s. A turn with a cache there starts instead on a host running nothing (cold, but on
    capacity that would idle); a host with a free slot that is running turns gets no such recompute (refused),
    while a new session, cold anywhere, takes that free slot."""
    idle = {"a": _busy("a", 6), "b": _busy("b", 6), "c": HostLoad("c", 2, 0, 0, 4.0, PREFILL, 1e9)}
    d = choose(idle, HELD, PROMPT, POLICY, session="s")
    assert d is not None and d.host == "a", d  # placement alone waits for the home (a cold move must wait 30 s)
    a = admit(d, idle, HELD, PROMPT, POLICY, RULE, session="s")
    assert isinstance(a, Decision) and a.host == "c" and a.reason == "overflow" and a.home == "a", a
    working = {**idle, "c": HostLoad("c", 2, 1, 0, 4.0, PREFILL, 1e9)}
    assert isinstance(_place(working, HELD), Refusal)
    new = _place(working, {})
    assert isinstance(new, Decision) and new.host == "c", new


def test_prefill_ahead_counts_against_the_patience() -> None:
    """A host prefilling 100k tokens (10 s) with a slot free: a new session's turn starts its own prefill within a
    running session's 10 s but not its own 2 s (a turn waits for the prefill engine as it would for a slot)."""
    hosts = {"a": HostLoad("a", 2, 1, 0, 4.0, PREFILL, 1e9, backlog_tokens=100_000)}
    assert isinstance(_place(hosts, {}, new_session=False), Decision)
    assert isinstance(_place(hosts, {}), Refusal)


def test_a_host_not_available_is_no_overflow_target() -> None:
    """The only free host is draining: the turn is refused rather than sent there."""
    hosts = {"a": _busy("a", 6), "c": HostLoad("c", 2, 0, 0, 4.0, PREFILL, 1e9, available=False)}
    assert isinstance(_place(hosts, HELD), Refusal)
    assert isinstance(_place({"a": _busy("a", 6), "c": HostLoad("c", 2, 0, 0, 4.0, PREFILL, 1e9)}, HELD,
                             unavailable=frozenset({"c"})), Refusal)


def test_admission_off_passes_every_decision() -> None:
    """With admission disabled (the baselines, or mesh.admission = false) a 14 s wait is queued, not refused."""
    hosts = {"a": _busy("a", 6), "b": _busy("b", 6)}
    d = choose(hosts, {}, PROMPT, POLICY, session="s")
    assert d is not None
    assert admit(d, hosts, {}, PROMPT, POLICY, Admission(enabled=False), session="s") is d


def test_the_retry_after_is_whole_seconds_at_least_one_and_at_most_the_cap() -> None:
    """A new session refused 0.1 s past its patience still says 1 s; 90 s past it says the 60 s the SDKs honour."""
    near = {"a": HostLoad("a", 2, 2, 0, 1.2, PREFILL, 1e9)}  # (0 + 1) x 1.2 / 2 = 0.6 s
    d = choose(near, {}, PROMPT, POLICY, session="s")
    assert d is not None
    r = admit(d, near, {}, PROMPT, POLICY, Admission(wait_s=10.0, new_wait_s=0.5), session="s")
    assert isinstance(r, Refusal) and r.new_session and r.retry_after_s == 1.0, r
    r = _place({"a": _busy("a", 49)}, HELD)  # 100 s
    assert isinstance(r, Refusal) and r.retry_after_s == RULE.max_retry_after_s == 60.0, r
