"""Where each policy sends a turn in `kvmesh sim`, and what it does after one.

- `kvmesh`: node.mesh.placement's `choose` on what the conversation's holdings are (stay home while
  it has a free slot, else the lowest expected TTFT of the moves that pay for themselves),
  a replica pushed after each turn to `push_target`'s host (none while it has turns queued), in node.kvshare.pushorder's order,
  and past `directory_after_hosts` one directory lookup (node.mesh.directory) per turn.
- `session_hash`: production-stack's SessionRouter: a session always goes to its hashed host.
- `kv_overlap`: Dynamo-style KV routing without replicas: the host with the lowest queue wait +
  prefill running there + uncached prefill, from every host's block events (engine and host-memory tiers).
- `least_loaded`, `round_robin`: no cache awareness.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from kvmesh.node.lab.sim.cluster import Cluster
from kvmesh.node.lab.sim.params import POLICIES
from kvmesh.node.lab.workload import TRACE_BLOCK_TOKENS, TraceRequest
from kvmesh.node.mesh.admission import Admission, Refusal, Reservations, admit_turn
from kvmesh.node.mesh.directory import directory_host
from kvmesh.node.mesh.placement import Holding, HostLoad, Policy, PushPlan, choose, home_of, push_target

NO_ADMISSION = Admission(enabled=False)


@dataclass(frozen=True)
class Route:
    host: str
    lookups: int = 0  # round trips to a directory before the forward
    counted_inbound: bool = False  # placement counted a replica still landing there (the turn waits for it)
    refused: Refusal | None = None  # refused as overloaded (node.mesh.admission): the client retries after its wait


class Router:
    """A policy: `route` a turn entering at `entry`; `replica_target` after a turn (its host None: no replica)."""

    name = ""
    replicates = False

    def __init__(self, cluster: Cluster, rng: random.Random, *, kv_bytes_per_token: int, directory_after_hosts: int,
                 admission: Admission = NO_ADMISSION):
        self.cluster, self.rng = cluster, rng
        self.placement = Policy(kv_bytes_per_token=kv_bytes_per_token)
        self.admission = admission
        self.reservations = Reservations(cap=1 << 30)  # the places in line refused turns hold (every entry's)
        self.directory = len(cluster.names) > directory_after_hosts

    def route(self, req: TraceRequest, entry: str, now: float) -> Route:
        raise NotImplementedError

    def replica_target(self, session: str, now: float) -> PushPlan:
        return PushPlan(None)


class KvmeshRouter(Router):
    name, replicates = "kvmesh", True

    def route(self, req: TraceRequest, entry: str, now: float) -> Route:
        c = self.cluster
        lookups = int(self.directory and directory_host(req.session, c.names) != entry)
        held = c.holdings(req.thread, now)  # a thread's cache is its own (subagents share the session id)
        cands = self._candidates(held, req.thread, req.input_length)
        # A subagent's conversation starts beside its session's main one while that host has room (node.mesh.threads).
        group_home = home_of(c.holdings(req.session, now)) if req.thread != req.session and home_of(held) is None else None
        if group_home is not None:
            cands[group_home] = c.loads()[group_home]
        d = choose(cands, held, req.input_length, self.placement, session=req.thread, group_home=group_home)
        assert d is not None, "every simulated host is available"
        # A subagent's first turn belongs to a running session; a session's turn is new while no host holds anything
        # of it (its first, or the next after the first failed), as the node judges it.
        a = admit_turn(self.reservations, req.thread, now, d, cands, held, req.input_length, self.placement, self.admission,
                       new_session=False if req.thread != req.session else None)
        if isinstance(a, Refusal):
            return Route(d.host, lookups, refused=a)
        d = a
        h = held.get(d.host)
        counted = h is not None and h.inbound > max(h.resident, h.stored) and d.predicted_reused >= h.inbound - TRACE_BLOCK_TOKENS
        return Route(d.host, lookups, counted)

    def replica_target(self, session: str, now: float) -> PushPlan:
        held = self.cluster.holdings(session, now)
        home = max(held.values(), key=lambda h: h.home_seq, default=None)
        size = max(home.resident, home.stored) if home is not None else 0
        return push_target(self._candidates(held, session, size), held, self.placement, session=session)

    def _candidates(self, held: dict[str, Holding], session: str, prompt: int) -> dict[str, HostLoad]:
        """The hosts `choose` weighs: every host holding something of the session, the three that a
        turn reusing nothing would start soonest on, and the three such of the idle hosts (a cold move
        goes only to one of those). With every host's prefill rate equal (as here), a host holding
        nothing can only win as one of those, so the decision is the one over all hosts, at a cost that
        does not grow with the mesh."""
        loads, c = self.cluster.loads(), self.cluster
        # With no home, the host its id hashes to (rendezvous: it wins among any hosts that include it), where a
        # new conversation goes when every host's queue is deep (node.mesh.placement.Policy.spread_new_after_s).
        spot = () if home_of(held) is not None else (directory_host(session, c.names),)
        return {n: loads[n] for n in (*held, *spot, *c.least_loaded(3, session, prompt),
                                      *c.least_loaded(3, session, prompt, idle=True))}


class SessionHashRouter(Router):
    name = "session_hash"

    def route(self, req: TraceRequest, entry: str, now: float) -> Route:
        return Route(directory_host(req.session, self.cluster.names))


class KvOverlapRouter(Router):
    name = "kv_overlap"

    def route(self, req: TraceRequest, entry: str, now: float) -> Route:
        def cost(name: str) -> tuple[float, int, float]:
            h = self.cluster.hosts[name]
            held = max(h.engine.prefix(req.blocks), h.store.prefix(req.blocks))  # both tiers, as a KV block manager's
            cached = min(held * TRACE_BLOCK_TOKENS, req.input_length - 1)
            load = loads[name]
            return (load.ahead_s() + (req.input_length - cached) / h.prefill_tps, h.busy,
                    self.rng.random())

        loads = self.cluster.loads()

        return Route(min(self.cluster.names, key=cost))


class LeastLoadedRouter(Router):
    name = "least_loaded"

    def route(self, req: TraceRequest, entry: str, now: float) -> Route:
        loads = self.cluster.loads()
        return Route(min(self.cluster.names, key=lambda n: ((loads[n].busy + loads[n].queued) / loads[n].slots,
                                                              self.rng.random())))


class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self, *args: object, **kw: int) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self._next = itertools.cycle(self.cluster.names)

    def route(self, req: TraceRequest, entry: str, now: float) -> Route:
        return Route(next(self._next))


ROUTERS: dict[str, type[Router]] = {r.name: r for r in (KvmeshRouter, SessionHashRouter, KvOverlapRouter,
                                                         LeastLoadedRouter, RoundRobinRouter)}
assert tuple(ROUTERS) == POLICIES, "params.POLICIES names every router, in order"
