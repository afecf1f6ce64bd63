"""The event loop of `kvmesh sim`: clients send turns, hosts run them, kv_share pushes replicas, in virtual time.

A client sends a turn to a random entry host (a load balancer in front of the mesh); the policy
picks the host; a lookup and a forward cost a round trip each. Clients are node.lab.clientmodel's: a
refused turn is retried after Retry-After (or a backoff) until the client's retries run out, and a
turn whose first token would come after the client's timeout fails there (its host is spared the
work, as an engine aborts a request whose client is gone); either way the conversation goes on
with its next turn. A host runs up to `slots` turns,
FIFO; a turn's prefill queues for the host's one prefill engine (chunked prefill runs one prompt
at a time), after importing what it reuses from the replica store, then decodes on its slot. Only
what the engine or the store holds is reused: the prefix of the prompt's blocks found there.
After a turn, every host keeps the session in its own store (kvmesh's persist_own, a CPU offload
tier elsewhere), and kvmesh pushes the blocks the predicted next host lacks over this host's link, one push at a time, the most valuable first, a newer replica of
a session replacing its queued one. Placement sees each host's state as of the moment (the
push interval's staleness is not modelled; it would cost every load-aware policy alike).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.node.kvshare.pushorder import PushFacts, push_key
from kvmesh.node.kvshare.store.manifest import common_prefix
from kvmesh.node.lab.clientmodel import ClientModel
from kvmesh.node.lab.sim.cluster import BlockLRU, Cluster, SimHost, StoreLRU
from kvmesh.node.lab.sim.control import Sizes, load_stream_bytes
from kvmesh.node.lab.sim.params import SimParams
from kvmesh.node.lab.sim.policies import ROUTERS, Route, Router
from kvmesh.node.lab.workload import TRACE_BLOCK_TOKENS, TraceRequest
from kvmesh.node.mesh.admission import Admission
from kvmesh.node.mesh.statestream import MIN_GAP_S
from kvmesh.node.protocol import classify


@dataclass
class _Turn:
    req: TraceRequest
    sent: float
    route: Route
    first_sent: float  # its first attempt (earlier than `sent` when it was refused and retried)
    ttft: float = 0.0
    todo: int = 0  # tokens it prefills
    started: bool = False
    failed: bool = False  # its client gave up waiting (the timeout) while it queued


@dataclass
class _Push:
    session: str
    blocks: tuple[int, ...]
    dst: str
    nbytes: int


@dataclass
class Figures:
    turns: int = 0
    ttft: list[float] = field(default_factory=list)  # from the attempt that was served
    ttft_with_retries: list[float] = field(default_factory=list)  # from its first attempt
    refused: int = 0  # attempts refused as overloaded (each retried after its Retry-After)
    refused_new: int = 0  # ...of them, sessions' first turns
    turns_refused: int = 0  # turns refused at least once
    failed_refused: int = 0  # turns whose client ran out of retries
    failed_timeout: int = 0  # turns whose first token would have come after the client's timeout
    prefill_tokens: int = 0
    prompt_tokens: int = 0
    follow: Counter[str] = field(default_factory=Counter)  # follow-up turns by class
    moves: Counter[str] = field(default_factory=Counter)  # follow-ups on another host than the last
    replica_bytes: int = 0
    pushes_held_back: int = 0  # replicas not pushed: the host the session would move to had turns queued
    lookups: int = 0
    forwards: int = 0
    session_deltas: int = 0
    kv_events: int = 0
    end: float = 0.0


class Simulation:
    def __init__(self, params: SimParams, requests: list[TraceRequest]) -> None:
        p = self.p = params
        self.rng = random.Random(p.seed)
        blocks = lambda n: max(1, n // TRACE_BLOCK_TOKENS)  # noqa: E731
        hosts = [SimHost(f"h{i:03d}", p.slots, p.prefill_tps, p.decode_tps, p.import_gbps * 1e9 / 8,
                         BlockLRU(blocks(p.engine_tokens)), StoreLRU(blocks(p.store_tokens))) for i in range(p.hosts)]
        self.cluster = Cluster(hosts)
        admission = Admission(wait_s=p.admit_wait_s, new_wait_s=p.admit_new_wait_s, enabled=p.admission)
        self.router: Router = ROUTERS[p.policy](self.cluster, self.rng, kv_bytes_per_token=p.kv_bytes_per_token,
                                                directory_after_hosts=p.directory_after_hosts, admission=admission)
        self.fig = Figures()
        self._events: list[tuple[float, int, Callable[..., None], tuple[object, ...]]] = []
        self._order = itertools.count()
        self._clients: dict[str, deque[TraceRequest]] = defaultdict(deque)
        for r in requests:
            self._clients[r.client or r.session].append(r)
        self._last_host: dict[str, str] = {}
        self._pushes: dict[str, list[_Push]] = defaultdict(list)
        self._link_busy: set[str] = set()
        self._think: dict[str, tuple[float, float]] = {}  # session -> (last reply, think-time EWMA)
        self.client = ClientModel(retries=p.client_retries, timeout_s=p.client_timeout_s)
        self._jitter = random.Random(p.seed * 7919 + 1)  # the clients' backoff, apart from the entries' draws
        self._retrying: dict[str, tuple[float, int]] = {}  # client -> (its refused turn's first attempt, retries made)

    def _at(self, t: float, handler: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._events, (t, next(self._order), handler, args))

    def run(self) -> Figures:
        for client, reqs in self._clients.items():
            self._at(reqs[0].t, self._send, client)
        while self._events:
            t, _, handler, args = heapq.heappop(self._events)
            handler(t, *args)
        return self.fig

    # ---- a turn ----------------------------------------------------------------------

    def _send(self, now: float, client: str) -> None:
        req = self._clients[client].popleft()
        if self.p.until_s is not None and now > self.p.until_s:
            self._clients[client].clear()
            return
        entry = self.rng.choice(self.cluster.names)
        first, retries = self._retrying.pop(client, (now, 0))
        route = self.router.route(req, entry, now)
        self.fig.lookups += route.lookups
        if route.refused is not None:
            # Refused at the entry: the client hears it a round trip later and sends again after Retry-After
            # (whole seconds, as the node's header says it: node.api.errors), or gives up.
            self.fig.refused += 1
            self.fig.refused_new += route.refused.new_session
            self.fig.turns_refused += retries == 0
            heard = now + self.p.rtt_s * (1 + route.lookups)
            delay = self.client.retry_delay(retries, max(1, round(route.refused.retry_after_s)), self._jitter)
            if delay is None:
                self.fig.failed_refused += 1
                self._next_turn(heard, client)
                return
            self._retrying[client] = (first, retries + 1)
            self._clients[client].appendleft(req)
            self._at(heard + delay, self._send, client)
            return
        self.fig.forwards += route.host != entry
        delay = self.p.rtt_s * (route.lookups + (route.host != entry))
        turn = _Turn(req, now, route, first, ttft=delay)
        host = self.cluster.hosts[route.host]
        if host.busy < host.slots and len(host.queue) == host.abandoned:
            self._start(now, host, turn)
        else:
            host.queue.append(turn)
            # What it will prefill, as the node's slot queue counts it: the prompt less what the host holds of it now.
            held = max(host.engine.prefix(req.blocks), host.store.prefix(req.blocks)) * TRACE_BLOCK_TOKENS
            turn.todo = max(0, req.input_length - held)
            host.queued_tokens += turn.todo
            self.cluster.changed(host)
            self._at(now + self.client.timeout_s, self._expire, host.name, turn)

    def _next_turn(self, now: float, client: str) -> None:
        """The conversation goes on: its next turn after its think time (never before its trace time)."""
        queue = self._clients[client]
        if queue:
            self._at(max(queue[0].t, now + queue[0].think_s), self._send, client)

    def _expire(self, now: float, name: str, turn: _Turn) -> None:
        """The client's timeout, for a turn that queued: one still queued fails, and leaves the queue."""
        if turn.started:
            return
        host = self.cluster.hosts[name]
        turn.failed = True
        host.abandoned += 1
        host.queued_tokens -= turn.todo
        self.cluster.changed(host)
        self.fig.failed_timeout += 1
        self._next_turn(now, turn.req.client or turn.req.session)

    def _start_next(self, now: float, host: SimHost) -> None:
        """A slot freed: the first queued turn whose client still waits starts."""
        while host.queue:
            nxt = host.queue.popleft()
            assert isinstance(nxt, _Turn)
            if nxt.failed:
                host.abandoned -= 1
                continue
            host.queued_tokens -= nxt.todo
            if self._start(now, host, nxt):
                return

    def _start(self, now: float, host: SimHost, turn: _Turn) -> bool:
        """Start the turn on a slot (False: its first token would come after its client's timeout, so it fails
        and the slot stays free)."""
        req, c = turn.req, self.cluster
        turn.started = True
        held = c.holding(req.thread, host.name)
        begin = now
        if turn.route.counted_inbound and held.inbound and held.inbound_eta > now:
            begin = held.inbound_eta  # placement counted the replica landing here: the turn waits for it
        engine = host.engine.prefix(req.blocks)
        store = host.store.prefix(req.blocks) if begin == now else max(host.store.prefix(req.blocks),
                                                                       common_prefix(held.inbound, req.blocks))
        reused = min(max(engine, store) * TRACE_BLOCK_TOKENS, req.input_length - 1)
        imported = max(0, store - engine) * TRACE_BLOCK_TOKENS
        start = max(begin, host.prefill_free_at)
        prefill_s = imported * self.p.kv_bytes_per_token / host.import_bps + (req.input_length - reused) / host.prefill_tps
        if turn.ttft + start + prefill_s - turn.sent > self.client.timeout_s:
            self.fig.failed_timeout += 1
            self._next_turn(max(now, turn.sent + self.client.timeout_s), req.client or req.session)
            return False
        host.busy += 1
        host.changes.append(now)
        host.prefill_free_at = start + prefill_s
        turn.todo = req.input_length - reused
        host.backlog += turn.todo
        c.changed(host)
        turn.ttft += start + prefill_s - turn.sent
        self.fig.prefill_tokens += turn.todo
        self.fig.prompt_tokens += req.input_length
        self._account_reuse(req, host.name, reused)
        seq = 1 + max((max(h.home_seq, h.turn_seq) for h in c.held[req.thread].values()), default=0)
        held.home_seq = held.turn_seq = seq
        held.blocks = req.blocks
        evicted = host.engine.add(req.blocks)
        self.fig.session_deltas += 1
        self.fig.kv_events += len(req.blocks) - engine + len(evicted)
        self._at(start + prefill_s, self._prefilled, host.name, turn, now)
        return True

    def _account_reuse(self, req: TraceRequest, host: str, reused: int) -> None:
        prev = self._last_host.get(req.thread)
        self._last_host[req.thread] = host
        if prev is not None and prev != host:
            # The old home hears it is home no more: its copy is a replica now (a real node does so
            # when a peer reports the session homed there: Mesh._heard).
            old = self.cluster.holding(req.thread, prev)
            self.cluster.hosts[prev].store.demote(old.stored)
        if req.turn == 0 or req.shared <= 0:
            return
        cls = classify(min(1.0, reused / req.shared))
        self.fig.follow[cls] += 1
        if prev is not None and prev != host:
            self.fig.moves[cls] += 1

    def _prefilled(self, now: float, name: str, turn: _Turn, started: float) -> None:
        host = self.cluster.hosts[name]
        host.backlog -= turn.todo
        self.cluster.changed(host)
        self.fig.ttft.append(turn.ttft)
        self.fig.ttft_with_retries.append(turn.ttft + turn.sent - turn.first_sent)
        self._at(now + turn.req.output_length / self.p.decode_tps, self._done, name, turn, started)

    def _done(self, now: float, name: str, turn: _Turn, started: float) -> None:
        host, req = self.cluster.hosts[name], turn.req
        host.busy -= 1
        host.changes.append(now)
        self.fig.end = max(self.fig.end, now)
        host.busy_slot_s += now - started
        host.mean_turn_s = 0.8 * host.mean_turn_s + 0.2 * (now - started)
        self.cluster.changed(host)
        self.fig.turns += 1
        self.fig.session_deltas += 1
        last, think = self._think.get(req.thread, (now, 10.0))
        self._think[req.thread] = (now, think)
        # Every policy's hosts keep their own sessions in host memory (kvmesh's persist_own; a vLLM with
        # CPU offload, llama-server's --cache-ram): the routing is what differs, and kvmesh's replicas.
        host.store.add(req.blocks, own=True)
        self.cluster.holding(req.thread, host.name).stored = req.blocks
        if self.router.replicates:
            self._after_turn(now, host, req)
        self._start_next(now, host)
        self._next_turn(now, req.client or req.session)

    # ---- kv_share: replicas after a turn ---------------------------------------------

    def _after_turn(self, now: float, host: SimHost, req: TraceRequest) -> None:
        if req.input_length < self.p.replicate_min_tokens:
            return
        plan = self.router.replica_target(req.thread, now)
        self.fig.pushes_held_back += plan.held_back is not None
        target = plan.host
        if target is None or target == host.name:
            return
        dst = self.cluster.hosts[target]
        have = max(dst.engine.prefix(req.blocks), dst.store.prefix(req.blocks))
        nbytes = (len(req.blocks) - have) * TRACE_BLOCK_TOKENS * self.p.kv_bytes_per_token
        if nbytes <= 0:
            return
        queue = self._pushes[host.name]
        queue[:] = [j for j in queue if j.session != req.thread]  # a newer replica replaces a queued one
        queue.append(_Push(req.thread, req.blocks, target, nbytes))
        self._pump(now, host)

    def _pump(self, now: float, host: SimHost) -> None:
        queue = self._pushes[host.name]
        if host.name in self._link_busy or not queue:
            return
        link_bps = self.p.link_gbps * 1e9
        p_move = 1.0 if host.queue or host.busy >= host.slots else host.busy / host.slots  # as PushSender

        def key(j: _Push) -> tuple[float, float]:
            last, think = self._think.get(j.session, (now, 10.0))
            return push_key(PushFacts(j.nbytes, think - (now - last), p_move), link_bps)

        job = min(queue, key=key)
        queue.remove(job)
        secs = 8 * job.nbytes / link_bps
        held = self.cluster.holding(job.session, job.dst)
        held.inbound, held.inbound_eta = job.blocks, now + secs
        self._link_busy.add(host.name)
        host.link_busy_s += secs
        self.fig.session_deltas += 1
        self._at(now + secs, self._landed, host.name, job)

    def _landed(self, now: float, src: str, job: _Push) -> None:
        dst = self.cluster.hosts[job.dst]
        dst.store.add(job.blocks, own=False)
        held = self.cluster.holding(job.session, job.dst)
        held.stored, held.inbound = job.blocks, ()
        self.fig.replica_bytes += job.nbytes
        self.fig.session_deltas += 1
        self._link_busy.discard(src)
        self._pump(now, self.cluster.hosts[src])

    # ---- the figures -------------------------------------------------------------------

    def summary(self, duration_s: float) -> dict[str, object]:
        f, p, n = self.fig, self.p, len(self.cluster.hosts)
        sizes = Sizes.measured()
        ttft, with_retries = sorted(f.ttft), sorted(f.ttft_with_retries)
        failed = f.failed_refused + f.failed_timeout
        turns = f.turns + failed
        follow, moves = sum(f.follow.values()), sum(f.moves.values())
        load_aware = p.policy in ("kvmesh", "kv_overlap", "least_loaded")
        control = 0
        if load_aware:
            control += sum(load_stream_bytes(h.changes, duration_s, n - 1, sizes, interval_s=MIN_GAP_S,
                                             heartbeat_s=p.heartbeat_s) for h in self.cluster.hosts.values())
        if p.policy == "kvmesh":
            fanout = 1 if n > p.directory_after_hosts else n - 1
            control += f.session_deltas * fanout * sizes.session_delta + f.lookups * sizes.lookup
        if p.policy == "kv_overlap":
            control += f.kv_events * (n - 1) * sizes.kv_event
        util = sum(h.busy_slot_s for h in self.cluster.hosts.values()) / (n * p.slots * duration_s)
        links = [h.link_busy_s / duration_s for h in self.cluster.hosts.values()]
        return {
            "hosts": n, "policy": p.policy, "requests": f.turns,
            "warm_pct": round(100.0 * f.follow["warm"] / follow, 2) if follow else None,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            # A refused attempt is not a served request (as every serving benchmark counts a 429); what the
            # retries cost its turn is in ttft_with_retries_p99_s.
            "goodput_per_s": round(sum(1 for x in ttft if x <= p.slo_s) / duration_s, 4), "slo_s": p.slo_s,
            "refused": f.refused, "refused_new_sessions": f.refused_new,
            "refused_pct": round(100.0 * f.refused / (f.turns + f.refused + f.failed_timeout), 2) if turns else 0.0,
            # What the clients lived: turns that failed in their face (out of retries, or timed out), turns refused
            # at least once, refusals per turn, and a served turn's TTFT from its first attempt.
            "client_retries": self.client.retries, "client_timeout_s": self.client.timeout_s,
            "failed_turns": failed, "failed_refused": f.failed_refused, "failed_timeout": f.failed_timeout,
            "failed_pct": round(100.0 * failed / turns, 2) if turns else 0.0,
            "turns_refused": f.turns_refused, "turns_refused_once_pct": round(100.0 * f.turns_refused / turns, 2) if turns else 0.0,
            "refusals_per_turn": round(f.refused / turns, 4) if turns else 0.0,
            "ttft_with_retries_p50_s": percentile(with_retries, 0.5),
            "ttft_with_retries_p99_s": percentile(with_retries, 0.99),
            "prefill_tokens": f.prefill_tokens, "prompt_tokens": f.prompt_tokens,
            "replica_bytes": f.replica_bytes, "pushes_held_back": f.pushes_held_back,
            # in and out, per host: every byte one host sends another receives
            "control_bytes_per_host_s": round(2 * control / (n * duration_s), 1),
            "utilisation": round(util, 4),
            "link_utilisation": round(sum(links) / n, 4), "link_utilisation_max": round(max(links), 4),
            "follow_ups": follow, "follow_ups_by_class": dict(f.follow),
            "moves": moves, "moves_warm_pct": round(100.0 * f.moves["warm"] / moves, 2) if moves else None,
            "lookups_per_turn": round(f.lookups / f.turns, 3) if f.turns else 0.0,
            "forwards_per_turn": round(f.forwards / f.turns, 3) if f.turns else 0.0,
            "duration_s": round(duration_s, 1),
        }


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile of sorted `xs` (None when empty), to 4 places."""
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None
