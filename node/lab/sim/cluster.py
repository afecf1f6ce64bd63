"""The simulated hosts: slots and a prefill queue, KV blocks in an engine cache and a replica store, a link.

Blocks are a trace's 512-token blocks (node.lab.workload). An engine reuses any cached prefix of a
prompt (content-addressed, as llama.cpp's and kvmesh's block caches do); the replica store holds
what kv_share landed (and, as `persist_own` does, the host's own sessions) and is imported at
`import_bps`. What a host holds of each session is indexed by session, so kvmesh's placement sees
exactly what a real node's `holdings` would, and nothing of other sessions.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvmesh.node.lab.workload import TRACE_BLOCK_TOKENS
from kvmesh.node.mesh.placement import Holding, HostLoad, spread


class BlockLRU:
    """Up to `capacity` blocks, least recently used out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, block: int) -> bool:
        return block in self._d

    def prefix(self, blocks: Iterable[int]) -> int:
        """How many leading blocks are held (peeked: a placement estimate must not reorder the LRU)."""
        n = 0
        for b in blocks:
            if b not in self._d:
                break
            n += 1
        return n

    def add(self, blocks: Iterable[int]) -> list[int]:
        """Hold (and touch) `blocks`; returns the blocks evicted to make room."""
        d = self._d
        for b in blocks:
            d[b] = None
            d.move_to_end(b)
        out = []
        while len(d) > self.capacity:
            out.append(d.popitem(last=False)[0])
        return out

    def drop(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self._d.pop(b, None)

    def pop_oldest(self) -> None:
        self._d.popitem(last=False)


class StoreLRU:
    """A replica store: a host's own sessions and the replicas it received, in `capacity` blocks.
    Replicas go first when room is needed (a replica is the second copy of a session; the own one is
    where its next turn most likely runs); a replica block a turn here uses becomes the host's own."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.own = BlockLRU(capacity)
        self.replicas = BlockLRU(capacity)

    def __len__(self) -> int:
        return len(self.own) + len(self.replicas)

    def prefix(self, blocks: Iterable[int]) -> int:
        n = 0
        for b in blocks:
            if b not in self.own and b not in self.replicas:
                break
            n += 1
        return n

    def demote(self, blocks: tuple[int, ...]) -> None:
        """The session moved away: its blocks here are a replica now (evicted before own sessions)."""
        held = [b for b in blocks if b in self.own]
        self.own.drop(held)
        self.replicas.add(held)

    def add(self, blocks: tuple[int, ...], *, own: bool) -> None:
        if own:
            self.replicas.drop(blocks)
            self.own.add(blocks)
        else:
            self.replicas.add(b for b in blocks if b not in self.own)
        while len(self) > self.capacity:
            (self.replicas if len(self.replicas) else self.own).pop_oldest()


@dataclass
class Held:
    """What one host holds of one session."""

    blocks: tuple[int, ...] = ()  # its sequence in the engine as of its last turn here
    stored: tuple[int, ...] = ()  # its replica in the store
    inbound: tuple[int, ...] = ()  # a replica landing here...
    inbound_eta: float = 0.0  # ...whole at this time
    home_seq: int = 0
    turn_seq: int = 0


@dataclass
class SimHost:
    name: str
    slots: int
    prefill_tps: float
    decode_tps: float
    import_bps: float
    engine: BlockLRU
    store: StoreLRU
    busy: int = 0
    backlog: int = 0  # prompt tokens of its turns still to prefill (Engine.prefill_backlog)
    queue: collections.deque[object] = field(default_factory=collections.deque)
    abandoned: int = 0  # of the queued turns, those whose client gave up (skipped when a slot frees)
    queued_tokens: int = 0  # prompt tokens its queued turns will prefill (as far as their prefixes predict)
    prefill_free_at: float = 0.0
    link_free_at: float = 0.0
    mean_turn_s: float = 1.0
    busy_slot_s: float = 0.0  # slot-seconds of turns run (utilisation)
    link_busy_s: float = 0.0
    changes: list[float] = field(default_factory=list)  # times its load changed (pushed state)

    def load(self) -> HostLoad:
        return HostLoad(self.name, self.slots, self.busy, len(self.queue) - self.abandoned, self.mean_turn_s, self.prefill_tps,
                        self.import_bps, backlog_tokens=self.backlog, queued_tokens=self.queued_tokens)


def tokens(blocks: int, limit: int) -> int:
    return min(blocks * TRACE_BLOCK_TOKENS, limit)


class Cluster:
    """The hosts and, per session, what each host holds of it."""

    def __init__(self, hosts: list[SimHost]) -> None:
        self.hosts = {h.name: h for h in hosts}
        self.names = tuple(sorted(self.hosts))
        self.held: dict[str, dict[str, Held]] = collections.defaultdict(dict)
        self._loads = {h.name: h.load() for h in hosts}

    def holding(self, session: str, host: str) -> Held:
        return self.held[session].setdefault(host, Held())

    def holdings(self, session: str, now: float) -> dict[str, Holding]:
        """What placement is told each host holds of the session (node.mesh.mesh.Mesh.holdings)."""
        out = {}
        for name, h in self.held.get(session, {}).items():
            host = self.hosts[name]
            resident = host.engine.prefix(h.blocks) * TRACE_BLOCK_TOKENS
            stored = host.store.prefix(h.stored) * TRACE_BLOCK_TOKENS
            inbound = len(h.inbound) * TRACE_BLOCK_TOKENS if h.inbound else 0
            if resident or stored or inbound or h.home_seq:
                out[name] = Holding(resident, stored, inbound, max(0.0, h.inbound_eta - now), h.home_seq, h.turn_seq)
        return out

    def changed(self, host: SimHost) -> None:
        """The host's load changed (a turn started, ended or queued)."""
        self._loads[host.name] = host.load()

    def loads(self) -> dict[str, HostLoad]:
        return self._loads

    def least_loaded(self, k: int, session: str, prompt: int, *, idle: bool = False) -> list[str]:
        """The k hosts placement would put a `prompt`-token turn of `session` that reuses nothing on, in
        its order: expected TTFT (as `choose` rounds it), busy slots, the session's spread of the hosts;
        `idle`: of the hosts running nothing (the only ones a cold move may go to)."""
        def key(h: HostLoad) -> tuple[float, int, int, str]:
            return (round(h.ahead_s() + prompt / h.prefill_tps, 4), h.busy, spread(session, h.name), h.name)

        hosts = [h for h in self._loads.values() if h.busy == 0] if idle else self._loads.values()
        return [h.name for h in heapq.nsmallest(k, hosts, key=key)]
