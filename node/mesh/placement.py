"""Placement: which host runs a session's next turn, and where its replica should go.

One pure function, `choose`, answers both questions, so the kv_share target
(the host placement would pick if the home were busy) can never disagree with
where the turn would really go. The home (the host that ran the session last)
keeps the turn while it has a free slot and little prefill ahead. Otherwise every
available host is scored by expected time to first token: queue wait + the
prefill already running there + uncached tokens / that host's measured prefill
rate + import time; the replica holder usually wins, and waiting for the home
wins when that is quicker.

A move must pay for itself, counting what it costs the mesh and not only the
moved turn: the prefill it adds (what the target computes and imports beyond
what the home would) delays the turns behind it, so a move is taken only when
the turn's expected TTFT there plus `move_cost_factor` x that added prefill beats
waiting for the home. A move goes only to a host with a free slot (queued there,
its cache could be evicted before it starts). It is warm when it reuses
`warm_fraction` of the prompt; one that is not (it recomputes what the home
holds) is the rare exception: only to a host running nothing (no busy slot, no
prefill), so it spends capacity nobody is using and never deepens a queue, and
only once the wait at the home (for a slot, or for the prefill ahead of it there)
is long against what the move computes there: `cold_move_ratio` x its prefill
(and import) there, and never longer than `cold_move_after_s`. A short follow-up stuck behind
another session's 100k-token prefill at its home then moves, while a long
conversation waits for its cache. Under load, then, a turn moves warm or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from kvmesh.node.mesh.directory import directory_host


@dataclass(frozen=True)
class HostLoad:
    name: str
    slots: int
    busy: int
    queued: int
    mean_turn_s: float
    prefill_tps: float
    import_bps: float  # replica store -> engine, bytes/s
    available: bool = True  # reachable and not draining
    backlog_tokens: int = 0  # prompt tokens its running turns have still to prefill (a new prefill shares the engine)
    queued_tokens: int = 0  # prompt tokens the turns queued for its slots will prefill, before a turn queued after them

    @property
    def free(self) -> int:
        return max(0, self.slots - self.busy) if self.queued == 0 else 0

    def wait_s(self) -> float:
        """Expected queue wait: none with a free slot, else queue position x recent turn time."""
        if self.free:
            return 0.0
        return (self.queued + 1) * self.mean_turn_s / max(1, self.slots)

    def prefill_wait_s(self) -> float:
        """Time the prefill already running or queued there takes: a new prompt's prefill shares the engine
        with it (a queue of long prompts is longer than its length in turns says)."""
        return (self.backlog_tokens + self.queued_tokens) / self.prefill_tps

    def ahead_s(self) -> float:
        """Expected wait before a new turn's own prefill starts there: for a slot, and for the prefill engine to
        finish what is running and queued ahead of it, whichever is later (a queued turn needs both)."""
        return max(self.wait_s(), self.prefill_wait_s())

    def idle(self, policy: Policy) -> bool:
        """Running nothing (no busy slot, next to no prefill): the only host a move that is not warm may go to."""
        return self.busy == 0 and self.prefill_wait_s() <= policy.home_prefill_wait_s


@dataclass(frozen=True)
class Holding:
    """What one host holds of the session (tokens)."""

    resident: int = 0
    stored: int = 0
    inbound: int = 0
    inbound_eta_s: float = 0.0
    home_seq: int = 0  # the session's turn sequence when it was last homed here
    turn_seq: int = 0  # ...when its last turn ran here


@dataclass(frozen=True)
class Policy:
    warm_fraction: float = 0.9
    cold_move_after_s: float = 30.0
    kv_bytes_per_token: int = 8192
    # A free home keeps the turn while the prefill ahead of it there takes less than this: a shorter
    # one costs less than a move would save, and may already be over (pushed state is up to 0.25 s old).
    home_prefill_wait_s: float = 0.25
    # Seconds of TTFT that one second of prefill a move adds to the mesh costs, beyond the moved turn's own
    # (already in its estimate): the turns that reach its target while it runs wait for it. Measured in
    # `kvmesh sim` (agents, Mooncake; 2 and 8 hosts): 1, 2 and 4 within noise of each other; 2 counts the next one.
    move_cost_factor: float = 2.0
    # A move that is not warm needs a wait at the home this many times what it computes there (at most
    # cold_move_after_s). Measured in `kvmesh sim --sweep` (2 and 8 hosts, both traces): 10 moves the short
    # follow-ups that made Mooncake's p99 at 8 hosts (8-14 s behind 100k-token prefills at their homes); 30 let
    # Claude Code's p50 at 8 hosts slip, and a flat 3 s wait, whatever the recompute, cost 0.2-0.4 points of warm %.
    cold_move_ratio: float = 10.0
    # When every host would keep a new conversation waiting longer than this, it goes where its id hashes (beside
    # its session's home, for a subagent's), as session hashing would send it: queue estimates that deep rank hosts
    # worse than a hash does (placed by them, new conversations herded onto the host that looked shortest, and
    # `kvmesh sim` failed 3x session hashing's turns at 8 hosts and 1.2 on the Mooncake trace).
    spread_new_after_s: float = 60.0


@dataclass(frozen=True)
class Decision:
    host: str
    home: str | None
    prev_host: str | None  # where the session's last turn ran (a turn elsewhere is a handoff)
    predicted_reused: int
    expected_ttft_s: float
    reason: str
    best_held: int = 0  # the most of the session any host holds (what a move could at best reuse)


def home_of(holdings: dict[str, Holding]) -> str | None:
    """The host that ran the session last (or had it migrated to it)."""
    best = max(holdings.items(), key=lambda kv: (kv[1].home_seq, kv[0]), default=None)
    return best[0] if best is not None and best[1].home_seq > 0 else None


def most_held(holdings: dict[str, Holding]) -> int:
    """The most tokens of the session one host holds: resident, stored or landing."""
    return max((max(h.resident, h.stored, h.inbound) for h in holdings.values()), default=0)


def last_host_of(holdings: dict[str, Holding]) -> str | None:
    best = max(holdings.items(), key=lambda kv: (kv[1].turn_seq, kv[0]), default=None)
    return best[0] if best is not None and best[1].turn_seq > 0 else None


def next_seq(holdings: dict[str, Holding]) -> int:
    """The sequence number of the session's next turn (or migration), as far as we know."""
    return 1 + max((max(h.home_seq, h.turn_seq) for h in holdings.values()), default=0)


def estimate(h: HostLoad, held: Holding | None, prompt: int, policy: Policy) -> tuple[float, int, float]:
    """(expected TTFT seconds, tokens reused, seconds of h's prefill engine the turn takes) if it ran on h."""
    wait = h.ahead_s()
    reuse, extra, resident = 0, 0.0, 0
    if held is not None:
        reuse = resident = held.resident
        if held.stored > reuse:
            reuse = held.stored
            extra = (held.stored - held.resident) * policy.kv_bytes_per_token / max(h.import_bps, 1e6)
        if held.inbound > reuse:
            # A replica still in flight counts whole if it lands sooner than the recompute would
            # take (the turn waits for it there); otherwise the turn runs without waiting, and the
            # replica counts for nothing: the receiver commits it only once it has landed whole
            # (its bytes are authenticated at its end), so landed blocks are not usable before.
            gain_s = (held.inbound - reuse) / h.prefill_tps
            if held.inbound_eta_s < gain_s:
                reuse, extra = held.inbound, max(extra, held.inbound_eta_s)
    reuse = min(reuse, max(0, prompt - 1))
    work = max(0, reuse - resident) * policy.kv_bytes_per_token / max(h.import_bps, 1e6) + (prompt - reuse) / h.prefill_tps
    return wait + extra + (prompt - reuse) / h.prefill_tps, reuse, work


def spread(session: str, host: str) -> int:
    """The last tie-break: a per-session order of the hosts, so equal hosts share new sessions evenly
    (by name, the first host in the alphabet would take every tie) and every entry orders them alike."""
    return xxhash.xxh64_intdigest(f"{session}\x00{host}".encode())


def choose(
    hosts: dict[str, HostLoad],
    holdings: dict[str, Holding],
    prompt_tokens: int,
    policy: Policy,
    *,
    unavailable: frozenset[str] = frozenset(),
    session: str = "",
    group_home: str | None = None,
) -> Decision | None:
    """The host for this turn (None when no host can take it); `session` orders equal hosts. A new
    conversation of a session whose home is `group_home` (a subagent's) starts there while it has room."""
    home = home_of(holdings)
    prev = last_host_of(holdings)
    cands = [h for h in hosts.values() if h.available and h.name not in unavailable]
    if not cands:
        return None
    est = {h.name: estimate(h, holdings.get(h.name), prompt_tokens, policy) for h in cands}
    # Stay where the cache is while that host has a free slot and little prefill ahead (else a warm replica
    # elsewhere may start sooner: the scores decide). A new conversation of a session stays beside the
    # others while that costs nothing (what they share, a system prompt or tools, is cached there); when
    # that host is full a fresh one has nothing to lose elsewhere.
    for stay, reason in ((home, "home"), (group_home if home is None else None, "group")):
        if stay in est and hosts[stay].free and hosts[stay].prefill_wait_s() <= policy.home_prefill_wait_s:
            ttft, reuse, _ = est[stay]
            return Decision(stay, home, prev, reuse, ttft, reason)
    if home is None and min(h.ahead_s() for h in cands) > policy.spread_new_after_s:
        spot = group_home if group_home in est else directory_host(session, [h.name for h in cands])
        ttft, reuse, _ = est[spot]
        return Decision(spot, None, prev, reuse, ttft, "spread")
    home_wait = hosts[home].ahead_s() if home in est else None

    def allowed(name: str) -> bool:
        if home_wait is None or name == home or prompt_tokens == 0:
            return True
        ttft, reuse, work = est[name]
        home_ttft, _, home_work = est[home]  # type: ignore[index]
        target = hosts[name]
        if not target.free:
            # Queued there, the turn would find its cache there only if nothing evicted it meanwhile, and
            # a queue's wait is the least certain estimate: a move goes to a host that starts it now.
            return False
        # The move pays for itself: its TTFT, plus what the prefill it adds to the mesh costs the turns
        # behind it, beats waiting for the home (a warm replica adds an import; a stale one, its gap).
        if ttft + policy.move_cost_factor * max(0.0, work - home_work) >= home_ttft:
            return False
        if reuse >= policy.warm_fraction * prompt_tokens:
            return True
        # A move that is not warm recomputes what no host need recompute (or, when the home holds nothing
        # yet, it is mid-turn: its cache will be there): only onto idle capacity, after a wait long against
        # what it recomputes.
        return target.idle(policy) and home_wait > min(policy.cold_move_after_s, policy.cold_move_ratio * work)

    ok = [h for h in cands if allowed(h.name)]
    # Lowest expected TTFT; ties: the home, then more reuse, then fewer busy slots, then the session's spread.
    best = min(ok, key=lambda h: (round(est[h.name][0], 4), h.name != home, -est[h.name][1], h.busy,
                                  spread(session, h.name), h.name))
    ttft, reuse, _ = est[best.name]
    return Decision(best.name, home, prev, reuse, ttft, _reason(best, home, reuse, holdings))


def _reason(best: HostLoad, home: str | None, reuse: int, holdings: dict[str, Holding]) -> str:
    """Why `choose` picked `best` (beyond staying home or beside the group's home)."""
    if best.name == home:
        return "home" if best.free else "wait-for-home"
    if reuse and holdings.get(best.name) is not None:
        return "replica"
    return "new-session" if home is None else "least-loaded"


def predict_next(hosts: dict[str, HostLoad], holdings: dict[str, Holding], policy: Policy, *,
                 session: str = "") -> Decision | None:
    """Where the session would go if its home were busy now: the kv_share target."""
    home = home_of(holdings)
    if home is None:
        return None
    held = holdings[home]
    size = max(held.resident, held.stored)
    return choose(hosts, holdings, size, policy, unavailable=frozenset({home}), session=session)


@dataclass(frozen=True)
class PushPlan:
    """Where a turn's end pushes the session's replica (`host`; None: nowhere), and the host it would have gone
    to but for the turns queued there (`held_back`)."""

    host: str | None
    held_back: str | None = None


def push_target(hosts: dict[str, HostLoad], holdings: dict[str, Holding], policy: Policy, *,
                session: str = "") -> PushPlan:
    """Where a turn's end pushes the session's replica: `predict_next`'s host, or none while that host has
    turns queued. A move goes only to a host with a free slot, and a queue says it will have none soon:
    past capacity every host has one, and a push there costs both hosts CPU that no move uses."""
    d = predict_next(hosts, holdings, policy, session=session)
    if d is None:
        return PushPlan(None)
    return PushPlan(None, d.host) if hosts[d.host].queued else PushPlan(d.host)


POLICIES = ("kvmesh", "session_hash", "kv_overlap", "least_loaded", "round_robin")


def choose_by(name: str, hosts: dict[str, HostLoad], holdings: dict[str, Holding], prompt_tokens: int, policy: Policy, *,
              unavailable: frozenset[str] = frozenset(), session: str = "", turn: int = 0,
              group_home: str | None = None, group: str = "") -> Decision | None:
    """The host `mesh.policy` = `name` picks (None when no host can take it): `choose` for kvmesh; the
    baselines `kvmesh sim` compares it with, for an A/B on real hosts or a fallback: session_hash (the
    rendezvous hash, over the available hosts, of the session id the client sent, `group` (else `session`):
    a session router sees only that, so a subagent under its parent's id goes where the parent does; where
    node.mesh.directory puts it while all are up), kv_overlap (the lowest expected TTFT from what each host holds, no move rule), least_loaded
    (fewest busy and queued turns per slot), round_robin (the `turn`-th available host by name)."""
    if name == "kvmesh":
        return choose(hosts, holdings, prompt_tokens, policy, unavailable=unavailable, session=session,
                      group_home=group_home)
    cands = sorted(h.name for h in hosts.values() if h.available and h.name not in unavailable)
    if not cands:
        return None
    if name == "session_hash":
        host = directory_host(group or session, cands)
    elif name == "kv_overlap":
        host = min(cands, key=lambda n: (round(estimate(hosts[n], holdings.get(n), prompt_tokens, policy)[0], 4),
                                         spread(session, n), n))
    elif name == "least_loaded":
        host = min(cands, key=lambda n: ((hosts[n].busy + hosts[n].queued) / max(1, hosts[n].slots), spread(session, n), n))
    elif name == "round_robin":
        host = cands[turn % len(cands)]
    else:
        raise ValueError(f"unknown placement policy {name!r}; one of {', '.join(POLICIES)}")
    ttft, reuse, _ = estimate(hosts[host], holdings.get(host), prompt_tokens, policy)
    return Decision(host, home_of(holdings), last_host_of(holdings), reuse, ttft, name)
