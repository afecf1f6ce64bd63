"""Placement's arithmetic (node.mesh.placement, pure functions): what a host's holding predicts a turn there reuses."""

from __future__ import annotations

from collections import Counter

import pytest

from kvmesh.node.mesh.placement import Holding, HostLoad, Policy, PushPlan, choose, predict_next, push_target

PREFILL = 10_000.0  # tokens/s on every host here
PROMPT = 20_000


def _predict(held: Holding) -> tuple[int, float]:
    """(predicted reuse, expected TTFT) of a turn placed on b, the session's home a draining."""
    hosts = {"a": HostLoad("a", 2, 0, 0, 1.0, PREFILL, 1e9, available=False),
             "b": HostLoad("b", 2, 0, 0, 1.0, PREFILL, 1e9)}
    holdings = {"a": Holding(resident=PROMPT, home_seq=3, turn_seq=3), "b": held}
    d = choose(hosts, holdings, PROMPT, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "b", d
    return d.predicted_reused, d.expected_ttft_s


def test_an_inbound_replica_that_lands_before_the_recompute_counts_whole() -> None:
    """A replica landing in 0.5 s, against 1.6 s to recompute what it brings, counts in full (the turn waits)."""
    reuse, ttft = _predict(Holding(stored=4_000, inbound=20_000, inbound_eta_s=0.5))
    assert reuse == PROMPT - 1  # all but the last token (which the turn computes)
    assert abs(ttft - (0.5 + 1 / PREFILL)) < 1e-3, ttft


def test_a_slow_inbound_replica_counts_for_nothing_until_it_lands_whole() -> None:
    """A replica landing in 5 s, against 1.6 s to recompute, adds nothing: its landed blocks are not usable before
    its end (the receiver commits, and authenticates its bytes, only then)."""
    reuse, ttft = _predict(Holding(stored=4_000, inbound=20_000, inbound_eta_s=5.0))
    assert reuse == 4_000
    assert abs(ttft - (4_000 / 1e9 + (PROMPT - 4_000) / PREFILL)) < 1e-3, ttft


def test_a_slow_inbound_replica_never_predicts_less_than_what_is_stored() -> None:
    """Landed tokens below what the store holds add nothing: the stored replica is the prediction."""
    reuse, _ = _predict(Holding(stored=8_000, inbound=20_000, inbound_eta_s=5.0))
    assert reuse == 8_000
    reuse, _ = _predict(Holding(resident=9_000, inbound=20_000, inbound_eta_s=5.0))
    assert reuse == 9_000


def test_a_new_session_goes_where_no_prefill_is_running() -> None:
    """Two idle-slotted hosts: the one already prefilling 50k tokens is 5 s further from a first token."""
    hosts = {"a": HostLoad("a", 4, 1, 0, 1.0, PREFILL, 1e9, backlog_tokens=50_000),
             "b": HostLoad("b", 4, 1, 0, 1.0, PREFILL, 1e9)}
    d = choose(hosts, {}, 2_000, Policy(kv_bytes_per_token=1), session="new")
    assert d is not None and d.host == "b" and abs(d.expected_ttft_s - 0.2) < 1e-3, d


def test_equal_hosts_share_new_sessions_evenly() -> None:
    """Eight equal idle hosts: 800 new sessions spread over all of them (not all to the first name)."""
    hosts = {n: HostLoad(n, 4, 0, 0, 1.0, PREFILL, 1e9) for n in "abcdefgh"}
    picks = Counter(choose(hosts, {}, 1_000, Policy(), session=f"s{i}").host for i in range(800))  # type: ignore[union-attr]
    assert set(picks) == set(hosts) and max(picks.values()) < 2 * 800 / 8, picks


def test_a_follow_up_no_host_can_serve_warm_waits_for_its_home_unless_the_wait_dwarfs_its_prefill() -> None:
    """Home busy; the prompt doubled since the last turn, so no host can reuse 90% of it. A 5 s wait at the home
    is under 10 x the 1 s the replica holder would compute: the turn waits rather than move as a handoff that is
    not warm. A 20 s wait is over it: the turn moves to the idle replica holder, which computes what the home would."""
    hosts = {"a": HostLoad("a", 1, 1, 0, 5.0, PREFILL, 1e9), "b": HostLoad("b", 1, 0, 0, 1.0, PREFILL, 1e9),
             "c": HostLoad("c", 1, 0, 0, 1.0, PREFILL, 1e9)}
    held = {"a": Holding(resident=10_000, home_seq=4, turn_seq=4), "b": Holding(stored=10_000)}
    d = choose(hosts, held, 20_000, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "a" and d.reason == "wait-for-home", d
    hosts["a"] = HostLoad("a", 1, 1, 3, 5.0, PREFILL, 1e9)
    d = choose(hosts, held, 20_000, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "b" and d.reason == "replica", d


def _busy_home(wait_s: float, **target: int) -> dict[str, HostLoad]:
    """Home a: one slot, busy, its queue `wait_s` long; b as given (one slot)."""
    return {"a": HostLoad("a", 1, 1, max(0, round(wait_s) - 1), 1.0, PREFILL, 1e9),
            "b": HostLoad("b", 1, target.get("busy", 0), target.get("queued", 0), 1.0, PREFILL, 1e9,
                          backlog_tokens=target.get("backlog", 0))}


def test_a_cold_move_never_goes_to_a_busy_host_however_long_the_home_queue() -> None:
    """A 60 s queue at the home, b holding nothing: b with its one slot taken (or a prefill running) is no place to
    recompute the session (that deepens b's queue: load turns into recompute); an idle b is."""
    held = {"a": Holding(resident=20_000, home_seq=2, turn_seq=2)}
    for busy_b in ({"busy": 1}, {"backlog": 20_000}):
        d = choose(_busy_home(60, **busy_b), held, 21_000, Policy(kv_bytes_per_token=1))
        assert d is not None and d.host == "a", (busy_b, d)
    d = choose(_busy_home(60), held, 21_000, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "b" and d.reason == "least-loaded", d


def test_a_cold_move_waits_out_cold_move_after_s() -> None:
    """An idle b holding nothing: a 10 s queue at the home is waited out (under cold_move_after_s), a 60 s one is not."""
    held = {"a": Holding(resident=20_000, home_seq=2, turn_seq=2)}
    d = choose(_busy_home(10), held, 21_000, Policy(kv_bytes_per_token=1, cold_move_after_s=30))
    assert d is not None and d.host == "a", d
    d = choose(_busy_home(60), held, 21_000, Policy(kv_bytes_per_token=1, cold_move_after_s=30))
    assert d is not None and d.host == "b", d


def test_a_short_follow_up_behind_a_long_prefill_at_home_moves_to_idle_capacity() -> None:
    """Home a has a free slot but 100k tokens of another session's prefill ahead (10 s); the follow-up adds 2,100
    tokens to a 2,000-token conversation held nowhere else: recomputing it on an idle b (0.2 s) beats a wait 10 x
    that, so it moves; behind 3,000 tokens (0.3 s) it stays home, and a long conversation (200k tokens, 20 s to
    recompute) waits out the 10 s (cold_move_after_s is 30)."""
    hosts = {"a": HostLoad("a", 4, 1, 0, 1.0, PREFILL, 1e9, backlog_tokens=100_000),
             "b": HostLoad("b", 4, 0, 0, 1.0, PREFILL, 1e9)}
    short = {"a": Holding(resident=2_000, home_seq=2, turn_seq=2)}
    d = choose(hosts, short, 2_100, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "b" and d.reason == "least-loaded", d
    near = {**hosts, "a": HostLoad("a", 4, 1, 0, 1.0, PREFILL, 1e9, backlog_tokens=3_000)}
    d = choose(near, short, 2_100, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "a", d
    long = {"a": Holding(resident=200_000, home_seq=2, turn_seq=2)}
    d = choose(hosts, long, 200_100, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "a", d


def test_a_warm_move_never_joins_a_queue() -> None:
    """b holds the whole replica but has no free slot: the turn waits for its home, where it is resident (queued at
    b its replica could be evicted before it starts, and a queue's length is the least certain estimate)."""
    held = {"a": Holding(resident=20_000, home_seq=2, turn_seq=2), "b": Holding(stored=20_000)}
    d = choose(_busy_home(6, busy=1), held, 20_500, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "a", d
    d = choose(_busy_home(6), held, 20_500, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "b" and d.reason == "replica", d


def test_a_stale_replica_moves_only_when_the_wait_pays_for_its_recompute() -> None:
    """b's replica lacks the last 2,000 tokens the home holds (0.2 s of prefill the move adds to the mesh, counted
    twice by default: the moved turn's and the next one's behind it). A 1 s wait at the home is worth more than
    that (0.2 + 2 x 0.2 s), so it moves; a 0.5 s wait is not, so it waits, though b alone would be 0.3 s quicker."""
    held = {"a": Holding(resident=30_000, home_seq=2, turn_seq=2), "b": Holding(stored=28_000)}
    hosts = {"a": HostLoad("a", 2, 2, 0, 1.0, PREFILL, 1e12), "b": HostLoad("b", 2, 0, 0, 1.0, PREFILL, 1e12)}
    d = choose(hosts, held, 30_100, Policy(kv_bytes_per_token=1))  # home wait: 1.0 / 2 slots = 0.5 s
    assert d is not None and d.host == "a" and abs(d.expected_ttft_s - 0.51) < 1e-3, d
    hosts["a"] = HostLoad("a", 2, 2, 0, 2.0, PREFILL, 1e12)  # 1 s
    d = choose(hosts, held, 30_100, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "b" and d.reason == "replica", d


def test_a_home_busy_prefilling_gives_way_to_a_warm_replica_but_never_to_a_cold_host() -> None:
    """The home has a free slot but 50k tokens of another prompt to prefill (5 s): the idle replica holder
    starts the turn sooner, warm; with no replica anywhere the turn stays home rather than recompute."""
    hosts = {"a": HostLoad("a", 4, 1, 0, 1.0, PREFILL, 1e9, backlog_tokens=50_000),
             "b": HostLoad("b", 4, 0, 0, 1.0, PREFILL, 1e9)}
    home = {"a": Holding(resident=20_000, home_seq=2, turn_seq=2)}
    d = choose(hosts, {**home, "b": Holding(stored=20_000)}, 21_000, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "b" and d.reason == "replica", d
    d = choose(hosts, home, 21_000, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "a", d


def test_the_baseline_policies_place_as_their_names_say() -> None:
    """mesh.policy baselines: session_hash by the rendezvous hash of the session id the client sent (the next host
    by it when that one is down; a subagent's conversation under it with it), least_loaded by busy+queued per slot, round_robin by turn, kv_overlap by TTFT with no move rule (it takes
    the busy replica holder kvmesh would not queue behind); an unknown name is refused."""
    from kvmesh.node.mesh.directory import directory_host
    from kvmesh.node.mesh.placement import choose_by

    hosts = {"a": HostLoad("a", 2, 2, 0, 1.0, PREFILL, 1e9), "b": HostLoad("b", 2, 2, 1, 1.0, PREFILL, 1e9),
             "c": HostLoad("c", 2, 0, 0, 1.0, PREFILL, 1e9)}
    held = {"a": Holding(resident=20_000, home_seq=1, turn_seq=1), "b": Holding(stored=20_000)}
    pol = Policy(kv_bytes_per_token=1)
    for s in ("s1", "s2", "s3", "s4"):
        d = choose_by("session_hash", hosts, held, 20_500, pol, session=s)
        assert d is not None and d.host == directory_host(s, "abc") and d.reason == "session_hash", d
        down = choose_by("session_hash", hosts, held, 20_500, pol, session=s, unavailable=frozenset({d.host}))
        assert down is not None and down.host == directory_host(s, sorted(set("abc") - {d.host})), down
        # A conversation of the session other than its main one (node.mesh.threads' key) goes where the id sent does.
        sub = choose_by("session_hash", hosts, {}, 1, pol, session=f"{s}#0badcafe", group=s)
        assert sub is not None and sub.host == d.host, sub
    assert [choose_by("round_robin", hosts, held, 1, pol, turn=i).host for i in range(4)] == ["a", "b", "c", "a"]  # type: ignore[union-attr]
    assert choose_by("least_loaded", hosts, held, 1, pol).host == "c"  # type: ignore[union-attr]
    hosts["a"] = HostLoad("a", 2, 2, 6, 1.0, PREFILL, 1e9)  # the home's queue: 3.5 s
    hosts["b"] = HostLoad("b", 2, 2, 0, 1.0, PREFILL, 1e9)  # the replica holder, full: 0.5 s
    assert choose_by("kv_overlap", hosts, held, 20_500, pol).host == "b"  # type: ignore[union-attr]
    assert choose_by("kvmesh", hosts, held, 20_500, pol).host == "a"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="unknown placement policy"):
        choose_by("random", hosts, held, 1, pol)


def test_every_policy_name_is_one_config_sim_and_node_agree_on() -> None:
    """mesh.policy accepts exactly the policies `kvmesh sim` runs and placement implements."""
    import typing

    from kvmesh.node.config import MeshConfig
    from kvmesh.node.lab.sim.params import POLICIES as SIM
    from kvmesh.node.mesh.placement import POLICIES

    assert POLICIES == SIM == typing.get_args(MeshConfig.model_fields["policy"].annotation)
    assert MeshConfig().policy == "kvmesh"
    with pytest.raises(ValueError):
        MeshConfig(policy="random")  # type: ignore[arg-type]


def test_a_new_conversation_of_a_session_starts_beside_its_home_while_that_has_room() -> None:
    """A subagent's first turn goes to its session's home while it has a free slot, elsewhere once it is full."""
    hosts = {n: HostLoad(n, 4, 0, 0, 1.0, PREFILL, 1e9) for n in "abcd"}
    homes = {choose(hosts, {}, 2_000, Policy(), session=f"s{i}#sub", group_home="c").host  # type: ignore[union-attr]
             for i in range(20)}
    assert homes == {"c"}
    hosts["c"] = HostLoad("c", 4, 4, 0, 1.0, PREFILL, 1e9)
    d = choose(hosts, {}, 2_000, Policy(), session="s#sub", group_home="c")
    assert d is not None and d.host != "c" and d.reason == "new-session", d


def test_a_queue_of_long_prompts_is_longer_than_its_length_in_turns() -> None:
    """Both hosts full with one turn queued: a new session goes where the queued turn's prompt is short, not
    where its 200k tokens will hold the prefill engine for 20 s (a burst of subagents herded otherwise)."""
    hosts = {"a": HostLoad("a", 2, 2, 1, 1.0, PREFILL, 1e9, queued_tokens=200_000),
             "b": HostLoad("b", 2, 2, 1, 1.0, PREFILL, 1e9, queued_tokens=2_000)}
    for i in range(10):
        d = choose(hosts, {}, 5_000, Policy(), session=f"new{i}")
        assert d is not None and d.host == "b", d
    assert hosts["a"].ahead_s() == 20.0 and hosts["b"].ahead_s() == hosts["b"].wait_s() == 1.0


def test_a_replica_is_pushed_to_the_next_host_only_while_it_has_no_queue() -> None:
    """The push goes where the session would move next; to no host while that one has turns queued (a move
    goes only to a free slot), and the drain's target, predict_next, is still that host."""
    holdings = {"a": Holding(resident=PROMPT, home_seq=3, turn_seq=3)}
    free = {"a": HostLoad("a", 2, 2, 0, 1.0, PREFILL, 1e9), "b": HostLoad("b", 2, 1, 0, 1.0, PREFILL, 1e9)}
    assert push_target(free, holdings, Policy(), session="s") == PushPlan("b")
    queued = free | {"b": HostLoad("b", 2, 2, 3, 1.0, PREFILL, 1e9)}
    assert push_target(queued, holdings, Policy(), session="s") == PushPlan(None, held_back="b")
    assert push_target(queued, {}, Policy(), session="s") == PushPlan(None)  # no home: nothing to push
    d = predict_next(queued, holdings, Policy(), session="s")
    assert d is not None and d.host == "b", d
