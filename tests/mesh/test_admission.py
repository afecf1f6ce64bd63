"""Admission (node.mesh.admission, a pure function): which turns the mesh takes, moves or refuses as overloaded."""

from __future__ import annotations

from kvmesh.node.mesh.admission import Admission, Refusal, admit
from kvmesh.node.mesh.placement import Decision, Holding, HostLoad, Policy, choose

PREFILL = 10_000.0
PROMPT = 20_000
POLICY = Policy(kv_bytes_per_token=1)
RULE = Admission(wait_s=10.0, new_wait_s=2.0, max_wait_s=30.0)


def _busy(name: str, queued: int, mean_turn_s: float = 4.0) -> HostLoad:
    """Two slots, both busy, `queued` waiting: a turn placed there waits (queued + 1) x mean / 2."""
    return HostLoad(name, 2, 2, queued, mean_turn_s, PREFILL, 1e9)


def _place(hosts: dict[str, HostLoad], holdings: dict[str, Holding], **kw: object) -> Decision | Refusal:
    d = choose(hosts, holdings, PROMPT, POLICY, session="s")
    assert d is not None
    return admit(d, hosts, holdings, PROMPT, POLICY, RULE, session="s", **kw)  # type: ignore[arg-type]


def test_a_host_that_starts_the_turn_within_the_bound_is_kept() -> None:
    """The home has a free slot: the decision passes unchanged."""
    hosts = {"a": HostLoad("a", 2, 1, 0, 4.0, PREFILL, 1e9), "b": _busy("b", 0)}
    held = {"a": Holding(resident=PROMPT, home_seq=1, turn_seq=1)}
    d = _place(hosts, held)
    assert isinstance(d, Decision) and d.host == "a" and d.reason == "home", d


def test_no_host_within_the_bound_refuses_with_the_time_until_one_is() -> None:
    """Every host would make a running session wait 14 s against a 10 s bound: refused, retry after the 4 s over
    (when the queue is back within the bound, so it never drains while refused turns sit out their wait)."""
    hosts = {"a": _busy("a", 6), "b": _busy("b", 6)}
    held = {"a": Holding(resident=PROMPT, home_seq=1, turn_seq=1)}
    r = _place(hosts, held)
    assert isinstance(r, Refusal), r
    assert not r.new_session and r.bound_s == 10.0
    assert abs(r.wait_s - hosts["a"].wait_s()) < 1e-9 and abs(r.retry_after_s - 4.0) < 1e-9, r
    assert "overloaded" in r.message() and "retry after 4 s" in r.message()


def test_a_running_session_is_admitted_where_a_new_one_is_refused() -> None:
    """A 6 s wait everywhere: within a running session's 10 s, beyond a new session's 2 s."""
    hosts = {"a": _busy("a", 2), "b": _busy("b", 2)}
    running = _place(hosts, {"a": Holding(resident=PROMPT, home_seq=1, turn_seq=1)})
    assert isinstance(running, Decision) and running.host == "a", running
    new = _place(hosts, {})
    assert isinstance(new, Refusal) and new.new_session and new.bound_s == 2.0, new


def test_a_refused_turns_bound_grows_with_its_wait_up_to_the_cap() -> None:
    """After 5 s of refusals a new session's bound is 7 s (admitted at a 6 s wait); a running session's grows
    from 10 s the same way; neither passes max_wait_s (30 s): a 42 s queue is refused however long it waited."""
    hosts = {"a": _busy("a", 2), "b": _busy("b", 2)}
    assert isinstance(_place(hosts, {}, waited_s=3.0), Refusal)
    assert isinstance(_place(hosts, {}, waited_s=5.0), Decision)
    held = {"a": Holding(resident=PROMPT, home_seq=1, turn_seq=1)}
    mid = {"a": _busy("a", 6), "b": _busy("b", 6)}  # 14 s
    assert isinstance(_place(mid, held), Refusal)
    assert isinstance(_place(mid, held, waited_s=5.0), Decision)
    far = {"a": _busy("a", 20), "b": _busy("b", 20)}  # 42 s
    for holdings in ({}, held):
        r = _place(far, holdings, waited_s=600.0)
        assert isinstance(r, Refusal) and r.bound_s == RULE.max_wait_s, r


def test_an_overloaded_home_overflows_only_to_idle_capacity() -> None:
    """The home's wait is 14 s. A turn with a cache there starts instead on a host running nothing (cold, but on
    capacity that would idle); a host with a free slot that is running turns gets no such recompute (refused),
    while a new session, cold anywhere, takes that free slot."""
    held = {"a": Holding(resident=PROMPT, home_seq=1, turn_seq=1)}
    idle = {"a": _busy("a", 6), "b": _busy("b", 6), "c": HostLoad("c", 2, 0, 0, 4.0, PREFILL, 1e9)}
    d = choose(idle, held, PROMPT, POLICY, session="s")
    assert d is not None and d.host == "a", d  # placement alone waits for the home (a cold move must wait 30 s)
    a = admit(d, idle, held, PROMPT, POLICY, RULE, session="s")
    assert isinstance(a, Decision) and a.host == "c" and a.reason == "overflow" and a.home == "a", a
    working = {**idle, "c": HostLoad("c", 2, 1, 0, 4.0, PREFILL, 1e9)}
    assert isinstance(_place(working, held), Refusal)
    new = _place(working, {})
    assert isinstance(new, Decision) and new.host == "c", new


def test_prefill_backlog_with_a_free_slot_is_not_overload() -> None:
    """A host prefilling 100k tokens (10 s) with a slot free admits even a new session: it is working, not queueing."""
    hosts = {"a": HostLoad("a", 2, 1, 0, 4.0, PREFILL, 1e9, backlog_tokens=100_000)}
    d = _place(hosts, {})
    assert isinstance(d, Decision) and d.host == "a", d


def test_a_host_not_available_is_no_overflow_target() -> None:
    """The only free host is draining: the turn is refused rather than sent there."""
    hosts = {"a": _busy("a", 6), "c": HostLoad("c", 2, 0, 0, 4.0, PREFILL, 1e9, available=False)}
    held = {"a": Holding(resident=PROMPT, home_seq=1, turn_seq=1)}
    assert isinstance(_place(hosts, held), Refusal)
    assert isinstance(_place({"a": _busy("a", 6), "c": HostLoad("c", 2, 0, 0, 4.0, PREFILL, 1e9)}, held,
                             unavailable=frozenset({"c"})), Refusal)


def test_admission_off_passes_every_decision() -> None:
    """With admission disabled (the baselines, or mesh.admission = false) a 14 s wait is queued, not refused."""
    hosts = {"a": _busy("a", 6), "b": _busy("b", 6)}
    d = choose(hosts, {}, PROMPT, POLICY, session="s")
    assert d is not None
    assert admit(d, hosts, {}, PROMPT, POLICY, Admission(enabled=False), session="s") is d


def test_the_retry_after_is_at_least_a_second_and_at_most_the_cap() -> None:
    """A new session refused at a 0.6 s wait still says 1 s; hours of queue say the cap."""
    near = {"a": HostLoad("a", 2, 2, 0, 1.2, PREFILL, 1e9)}  # (0 + 1) x 1.2 / 2 = 0.6 s
    d = choose(near, {}, PROMPT, POLICY, session="s")
    assert d is not None
    r = admit(d, near, {}, PROMPT, POLICY, Admission(wait_s=10.0, new_wait_s=0.5), session="s")
    assert isinstance(r, Refusal) and r.new_session and r.retry_after_s == 1.0, r
    far = {"a": _busy("a", 5000)}
    r = _place(far, {"a": Holding(resident=PROMPT, home_seq=1, turn_seq=1)})
    assert isinstance(r, Refusal) and r.retry_after_s == RULE.max_retry_after_s, r
