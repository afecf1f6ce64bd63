"""The mesh as this node sees it: peers, session records, placement inputs, the cluster view.

What this host holds is asked of its engine and store on every call; what a
peer holds is what that peer last reported (at most `stale_after_s` old).
The mesh is given the engine, its config section, a publish function and a
`ReplicaView` (what kv_share holds, sends and receives); it never sees the Node.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ssl
import time
from collections.abc import Callable
from typing import Protocol

from kvmesh.node.config import MeshConfig
from kvmesh.node.engine.boundary import EngineAPI
from kvmesh.node.mesh.admission import Admission, Refusal, Reservations, admit_turn
from kvmesh.node.mesh.auth import peer_token
from kvmesh.node.mesh.clusterview import assemble
from kvmesh.node.mesh.directory import directory_host
from kvmesh.node.mesh.peers import PeerTable
from kvmesh.node.mesh.placement import (
    Decision,
    Holding,
    HostLoad,
    Policy,
    choose_by,
    home_of,
    last_host_of,
    most_held,
    next_seq,
    predict_next,
    push_target,
)
from kvmesh.node.mesh.sessions import SessionBook
from kvmesh.node.mesh.threads import KnownThreads
from kvmesh.node.protocol import (
    ClusterView,
    DirectoryEntry,
    Event,
    HostInfo,
    LinkInfo,
    PeerStatus,
    SessionHolding,
)

MAX_REFUSED_TRACKED = 10_000  # sessions whose place in line is kept (oldest forgotten first)


class ReplicaView(Protocol):
    """What the mesh asks of kv_share about this host's replicas (KVShare satisfies it)."""

    @property
    def wasted_bytes(self) -> int: ...

    def store_tokens(self, session: str) -> tuple[int, float | None]: ...

    def store_sessions(self) -> list[str]: ...

    def rehomed(self, session: str) -> None:
        """The session's home moved to another host: what this host stores of it is a replica now."""

    def inbound(self, session: str) -> tuple[int, float | None, int]:
        """(tokens of a replica landing here, seconds until it is whole, tokens of it landed so far)."""

    def inbound_sessions(self) -> list[str]:
        """Sessions with a replica landing here now."""

    def inflight_to(self, session: str) -> str | None: ...

    def import_bps(self) -> float: ...

    def links_out(self) -> list[LinkInfo]: ...


class Mesh:
    def __init__(self, name: str, cfg: MeshConfig, engine: EngineAPI, replicas: ReplicaView, *,
                 publish: Callable[[Event], object], host_info: Callable[[], HostInfo],
                 on_decision: Callable[[float], None], on_refused: Callable[[bool], None] = lambda new: None,
                 on_push_held_back: Callable[[], None] = lambda: None, verify: ssl.SSLContext | bool = True):
        """`host_info` reports this host (status polls and the cluster view); `on_decision` is
        told how long each placement decision took, `on_refused` of each turn refused as overloaded
        (whether it was a new session's), `on_push_held_back` of each replica not pushed at a turn's end for the
        turns queued where it would go; `verify` checks peers' TLS certificates."""
        self.name = name
        self.engine = engine
        self.replicas = replicas
        self._host_info = host_info
        self._on_decision = on_decision
        secrets = cfg.secrets()
        self.peer_token = peer_token(secrets[0]) if secrets else None
        self.secrets = secrets
        self.peers = PeerTable(cfg.peers, token=self.peer_token, poll_interval_s=cfg.poll_interval_s,
                               stale_after_s=cfg.stale_after_s, publish=publish, verify=verify,
                               subscriber=name if cfg.push_state else None, on_sessions=self._heard)
        self.directory_after_hosts = cfg.directory_after_hosts
        # Every host's name and the sessions' directory hosts, as of the peer table's `version`.
        self._members_version, self._members = -1, tuple[str, ...]()
        self._directory: dict[str, str] = {}
        self.book = SessionBook()
        self.known_threads = KnownThreads(cap_sessions=self.book.cap)  # every entry names a conversation alike
        self.draining = False
        self.policy = Policy(cfg.warm_fraction, cfg.cold_move_after_s, engine.kv_bytes_per_token)
        self.policy_name = cfg.policy  # mesh.policy: kvmesh, or a baseline (node.mesh.placement.choose_by)
        self._turns_placed = 0  # round_robin's counter
        # The baselines queue every turn, as the routers they stand for do; only kvmesh refuses early.
        self.admission = Admission(wait_s=cfg.admit_wait_s, new_wait_s=cfg.admit_new_wait_s,
                                   timeout_s=cfg.admit_client_timeout_s, enabled=cfg.admission and cfg.policy == "kvmesh")
        self._on_refused = on_refused
        self._on_push_held_back = on_push_held_back
        self.reservations = Reservations(cap=MAX_REFUSED_TRACKED)  # refused turns' places in line, by session
        self.refused = collections.Counter[str]()  # "new" / "running": turns refused as overloaded
        # Where this entry node last sent each session, and when: fresher than any poll.
        # session -> (host, turn sequence) of the last turn this entry placed; LRU, capped like the book
        self.routed: collections.OrderedDict[str, tuple[str, int]] = collections.OrderedDict()
        self.decision_s: collections.deque[float] = collections.deque(maxlen=5000)
        self.decision_cpu_s: collections.deque[float] = collections.deque(maxlen=5000)

    async def start(self) -> None:
        await self.peers.start()

    def _heard(self, peer: str, sessions: list[SessionHolding]) -> None:
        """A peer reported these sessions: one homed there since it was last homed here is not ours any more."""
        for sh in sessions:
            self.known_threads.heard(sh.group or sh.session, sh.session, sh.opening)
            rec = self.book.records.get(sh.session)
            if rec is not None and rec.home_seq and sh.home_seq > rec.home_seq and not rec.rehomed:
                rec.rehomed = True
                self.replicas.rehomed(sh.session)

    async def stop(self) -> None:
        await self.peers.stop()

    # ---- placement inputs ----------------------------------------------------

    def _self_load(self) -> HostLoad:
        e = self.engine
        return HostLoad(self.name, e.slots.slots, e.slots.busy, e.slots.queued, e.slots.mean_turn_s(),
                        e.prefill_rate(), self.replicas.import_bps(), available=not self.draining,
                        backlog_tokens=e.prefill_backlog(), queued_tokens=e.slots.queued_tokens)

    def hosts(self) -> dict[str, HostLoad]:
        out = {self.name: self._self_load()}
        for p in self.peers.peers.values():
            st = p.status
            if st is None:
                out[p.name] = HostLoad(p.name, 0, 0, 0, 1.0, 1.0, 1.0, available=False)
                continue
            h = st.host
            out[p.name] = HostLoad(p.name, h.slots, min(h.slots, h.busy + p.pending), h.queued, st.mean_turn_s,
                                   max(h.prefill_tps, 1.0), st.import_bps, available=p.reachable and not h.draining,
                                   backlog_tokens=h.prefill_backlog_tokens + p.pending_tokens,
                                   queued_tokens=h.queued_tokens)
        return out

    def local_holding(self, session: str) -> SessionHolding:
        r = self.replicas
        rec = self.book.records.get(session)
        stored, updated = r.store_tokens(session)
        inbound, eta, landed = r.inbound(session)
        return SessionHolding(
            session=session, resident_tokens=self.engine.resident_tokens(session), store_tokens=stored,
            store_updated=updated, home_seq=rec.home_seq if rec else 0, turn_seq=rec.turn_seq if rec else 0,
            last_turn_at=rec.last_turn_at if rec else 0.0, turns=rec.turns if rec else 0,
            moves=rec.moves if rec else 0, last_handoff=rec.last_handoff if rec else None,
            id_source=rec.id_source if rec else "", group=rec.group if rec else "", opening=rec.opening if rec else "",
            inflight_to=r.inflight_to(session), inbound_tokens=inbound, inbound_eta_s=eta,
            inbound_landed=landed,
        )

    def holdings(self, session: str) -> dict[str, Holding]:
        out: dict[str, Holding] = {}
        mine = self.local_holding(session)
        if _holds(mine):
            out[self.name] = _holding(mine)
        for p in self.peers.peers.values():
            sh = p.sessions.get(session)
            if sh is not None:
                out[p.name] = _holding(sh)
        routed = self.routed.get(session)
        if routed is not None:
            host, seq = routed
            cur = out.get(host, Holding())
            if seq > cur.turn_seq:
                out[host] = dataclasses.replace(cur, home_seq=max(seq, cur.home_seq), turn_seq=seq)
        return out

    def note_routed(self, session: str, host: str, seq: int) -> None:
        self.routed[session] = (host, seq)
        self.routed.move_to_end(session)
        while len(self.routed) > self.book.cap:
            self.routed.popitem(last=False)

    def known(self, session: str) -> bool:
        """Whether any host is known to have run this session (as far as this node has heard)."""
        return any(h.home_seq > 0 for h in self.holdings(session).values())

    def conversations_of(self, group: str) -> dict[str, str]:
        """The conversations of session id `group` this node has heard of: key -> signature (node.mesh.threads)."""
        out = dict(self.known_threads.of(group))
        if group not in out:  # its main one may be known only from a lookup (refresh), which is not a push
            rec = self.book.records.get(group)
            main = rec.opening if rec is not None and rec.opening else next(
                (sh.opening for p in self.peers.peers.values() if (sh := p.sessions.get(group)) and sh.opening), "")
            if main:
                out[group] = main
        return out

    def next_seq(self, session: str) -> int:
        return next_seq(self.holdings(session))

    async def refresh(self, session: str) -> None:
        """Ask where the session is now, rather than trust what was last pushed or polled: its
        directory host in a large mesh, else (or if that fails) every reachable peer.

        Used before placing a turn of a session this node does not know (another entry may have
        served its last turn moments ago), and on every turn whose directory is another host."""
        d = self.directory_of(session)
        peer = self.peers.peers.get(d) if d is not None else None
        if not (peer is not None and peer.reachable and await self.peers.lookup(peer, session)):
            await asyncio.gather(*(self.peers.poll_session(p, session) for p in self.peers.peers.values() if p.reachable))
        # The home's load too: what this node last heard of it may predate the turn it just ran (a
        # prefill shown running, a slot shown busy), and this decision is the one that counts.
        home = self.peers.peers.get(self.home(session) or "")
        if home is not None and home.reachable:
            await self.peers.poll(home)

    # ---- the directory (large meshes) ------------------------------------------

    def members(self) -> tuple[str, ...]:
        """Every host's name, this one's included (reachable or not: a directory must not flap)."""
        if self._members_version != self.peers.version:
            self._members_version = self.peers.version
            self._members = tuple(sorted([self.name, *self.peers.peers]))
            self._directory = {}  # the member set changed: every directory host is chosen again
        return self._members

    def directory_of(self, session: str) -> str | None:
        """The session's directory host once the mesh is past `directory_after_hosts`, else None."""
        members = self.members()
        if len(members) <= self.directory_after_hosts:
            return None
        cache = self._directory
        host = cache.get(session)
        if host is None:
            if len(cache) >= 4 * self.book.cap:
                cache.clear()
            host = cache[session] = directory_host(session, members)
        return host

    def needs_lookup(self, session: str) -> bool:
        """Whether to ask before placing a turn of `session` (see `refresh`)."""
        d = self.directory_of(session)
        return not self.known(session) or (d is not None and d != self.name)

    def scope_for(self, subscriber: str) -> Callable[[str], bool]:
        """Which sessions' state a subscriber is sent: all in a small mesh, its directory's in a large one."""
        return lambda session: self.directory_of(session) in (subscriber, None)

    def directory_entry(self, session: str) -> DirectoryEntry:
        """What this host knows every host holds of `session` (the directory's answer)."""
        held = {p.name: p.sessions[session] for p in self.peers.peers.values() if session in p.sessions}
        mine = self.local_holding(session)
        if _holds(mine):
            held[self.name] = mine
        return DirectoryEntry(session=session, held=held)

    def decide(self, session: str, prompt_tokens: int, *, unavailable: frozenset[str] = frozenset(),
               admit_turn: bool = False, group: str = "") -> Decision | Refusal | None:
        """The host for the turn (None: no host can take it); with `admit_turn`, checked by admission
        (node.mesh.admission) on the same hosts and holdings: another host that starts it within the bound,
        or a Refusal. A conversation of `group` other than its main one (node.mesh.threads) starts beside
        the group's home while that host has room."""
        # Wall time includes waiting for a core or the GIL; this thread's CPU time is the decision's own cost.
        t0, c0 = time.perf_counter(), time.thread_time()
        hosts, holdings = self.hosts(), self.holdings(session)
        thread = bool(group) and group != session  # a conversation of `group` other than its main one
        group_home = self.home(group) if thread and home_of(holdings) is None else None
        d = choose_by(self.policy_name, hosts, holdings, prompt_tokens, self.policy,
                      unavailable=unavailable, session=session, turn=self._turns_placed, group_home=group_home,
                      group=group)
        self._turns_placed += 1
        # A subagent's first turn belongs to a running session (as in kvmesh sim): only a session's first turn is new.
        out = self._admit(session, d, hosts, holdings, prompt_tokens, unavailable, thread=thread) if d is not None and admit_turn else d
        if isinstance(out, Decision):
            out = dataclasses.replace(out, best_held=most_held(holdings))
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        self.decision_s.append(dt)
        self.decision_cpu_s.append(dc)
        self._on_decision(dt)
        return out

    def _admit(self, session: str, d: Decision, hosts: dict[str, HostLoad], holdings: dict[str, Holding],
               prompt_tokens: int, unavailable: frozenset[str], *, thread: bool = False) -> Decision | Refusal:
        a = admit_turn(self.reservations, session, time.monotonic(), d, hosts, holdings, prompt_tokens, self.policy,
                       self.admission, unavailable=unavailable, new_session=False if thread else None)
        if isinstance(a, Refusal):
            self.refused["new" if a.new_session else "running"] += 1
            self._on_refused(a.new_session)
        return a

    def home(self, session: str) -> str | None:
        return home_of(self.holdings(session))

    def last_host(self, session: str) -> str | None:
        return last_host_of(self.holdings(session))

    @property
    def replicates(self) -> bool:
        """Whether a turn's end pushes a replica to the next host: kvmesh's policy does, the baselines do not."""
        return self.policy_name == "kvmesh"

    def predict_next(self, session: str) -> Decision | None:
        return predict_next(self.hosts(), self.holdings(session), self.policy, session=session)

    def push_target(self, session: str) -> str | None:
        """Where the session's replica goes after its turn here (placement.push_target)."""
        plan = push_target(self.hosts(), self.holdings(session), self.policy, session=session)
        if plan.held_back is not None:
            self._on_push_held_back()
        return plan.host

    def decision_ms(self, q: float, *, cpu: bool = False) -> float:
        xs = sorted(self.decision_cpu_s if cpu else self.decision_s)
        return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0

    # ---- status and the cluster view ----------------------------------------

    def links(self) -> list[LinkInfo]:
        """This host's links: transfers it sent (kv_share's figures), handoffs it received (the book's)."""
        out = {li.dst: li for li in self.replicas.links_out()}
        for src, lc in self.book.links_in.items():
            out[f"<-{src}"] = LinkInfo(src=src, dst=self.name, warm=lc.warm, partial=lc.partial, cold=lc.cold)
        return list(out.values())

    def local_status(self) -> PeerStatus:
        e, r = self.engine, self.replicas
        # A replica still landing is reported too: placement counts what of it has landed (or will).
        names = set(e.sessions) | set(self.book.records) | set(r.store_sessions()) | set(r.inbound_sessions())
        return PeerStatus(
            host=self._host_info(), sessions=[self.local_holding(s) for s in sorted(names)],
            counters=self.book.counters.model_copy(deep=True), links=self.links(),
            mean_turn_s=e.slots.mean_turn_s(), import_bps=r.import_bps(),
            kv_bytes_per_token=e.kv_bytes_per_token, wasted_replica_bytes=r.wasted_bytes,
        )

    def cluster(self) -> ClusterView:
        now = time.time()
        statuses: dict[str, PeerStatus] = {self.name: self.local_status()}
        hosts = [statuses[self.name].host]
        for p in self.peers.peers.values():
            if p.status is not None:
                statuses[p.name] = p.status
                h = p.status.host.model_copy(update={"reachable": p.reachable,
                                                     "last_seen": now - (time.monotonic() - p.heard_at)})
            else:
                h = HostInfo(name=p.name, api=p.cfg.api, reachable=False)
            hosts.append(h)
        return assemble(self.name, now, statuses, hosts)


def _holds(sh: SessionHolding) -> bool:
    """Whether this host holds anything of the session (or is or was its home)."""
    return bool(sh.resident_tokens or sh.store_tokens or sh.home_seq or sh.inbound_tokens)


def _holding(sh: SessionHolding) -> Holding:
    return Holding(sh.resident_tokens, sh.store_tokens, sh.inbound_tokens, sh.inbound_eta_s or 0.0, sh.home_seq,
                   sh.turn_seq)
