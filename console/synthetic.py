"""A synthetic mesh: deterministic cluster views and event streams, as JSON frames.

Used by `kvmesh-console bench` (2,000 sessions at 200 events/s, `--ended N` of
them long finished; `--hosts 256 --sessions 20000` for a big mesh), by `--demo` (the console with no nodes, for trying the UI,
the demo view and the browser view), and by tests. Ended sessions get no events;
live ones take turns, move, and have replicas pushed (started, then sent and ready). It emits exactly
what a node would put on the wire (protocol models serialized to JSON), so the
console's parse path is exercised too.

Past `directory_after_hosts` hosts it plays what a large mesh sends: one stream per host, each
cluster view that host's part only (the sessions it is home of or holds a replica of, and those it is
directory for, with the whole picture), so the console must merge the parts to see the mesh.

`threads` N: each client session is a main conversation and N threads of it (subagents' conversations),
keyed `<main>#<8 hex>` with the main's id as their group, as a node names them (`SessionInfo.group`).
"""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.node.protocol import (
    ClusterView,
    ClusterViewEvent,
    Event,
    Handoff,
    HandoffCounters,
    HostInfo,
    HostStatus,
    LinkInfo,
    ReplicaReady,
    ReplicaSent,
    ReplicaStarted,
    SessionInfo,
    TurnFinished,
    TurnStarted,
    classify,
)

GiB = 1 << 30
BLOCK = 256  # tokens per KV block, as the synthetic hosts report it


@dataclass
class _Sess:
    sid: str
    home: str
    tokens: int
    replica: str | None = None
    replica_tokens: int = 0
    replica_at: float | None = None
    turns: int = 0
    moves: int = 0
    last: str | None = None
    last_turn_at: float = 0.0
    group: str = ""


@dataclass
class SyntheticMesh:
    hosts: int = 4
    sessions: int = 2000
    seed: int = 7
    slots: int = 4
    ended: int = 0  # this many sessions (the first ones) finished long ago: no events for them
    threads: int = 0  # each client session: a main conversation and this many threads of it (see the docstring)
    directory_after_hosts: int = 16  # past this many hosts, each host's cluster view is its part (see the docstring)
    t0: float = 1_700_000_000.0
    _rng: random.Random = field(init=False)
    _seq: dict[str, int] = field(init=False, default_factory=dict)
    _sess: list[_Sess] = field(init=False, default_factory=list)
    _busy: dict[str, int] = field(init=False, default_factory=dict)
    # pushes moving now, oldest first: session id -> (target host, blocks offered)
    _inflight: dict[str, tuple[str, int]] = field(init=False, default_factory=dict)
    counters: HandoffCounters = field(init=False, default_factory=HandoffCounters)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self.host_names = [f"node-{i + 1}" for i in range(self.hosts)]
        self._host_index = {name: i for i, name in enumerate(self.host_names)}
        for name in self.host_names:
            self._seq[name] = 0
            self._busy[name] = 0
        for i in range(self.sessions):
            home = self.host_names[i % self.hosts]
            s = _Sess(sid=f"sess-{i:05d}", home=home, tokens=self._rng.randint(2_000, 60_000))
            if self.threads:
                main = f"sess-{i - i % (self.threads + 1):05d}"
                s.group = main
                if main != s.sid:
                    s.sid = f"{main}#{zlib.crc32(s.sid.encode()):08x}"
            if self._rng.random() < 0.7:
                s.replica = self.host_names[(i + 1) % self.hosts]
                # Whole blocks only; a few replicas lag by a block or four.
                s.replica_tokens = s.tokens // BLOCK * BLOCK - self._rng.choice([0, 0, 0, 0, BLOCK, 4 * BLOCK])
                s.replica_at = self.t0 - self._rng.uniform(1, 400)
            ended = i < self.ended
            s.last_turn_at = self.t0 - (self._rng.uniform(900, 5400) if ended else self._rng.uniform(1, 120))
            if ended and s.replica and self._rng.random() < 0.3:
                s.tokens = 0  # evicted from its engine; only the replica store holds it
            s.turns = self._rng.randint(1, 40)
            s.moves = self._rng.randint(0, 5)
            s.last = self._rng.choice([None, "warm", "warm", "warm", "partial", "cold"])
            self._sess.append(s)
        self.counters = HandoffCounters(warm=1200, partial=9, cold=2)
        self._live = self._sess[self.ended :]
        self._index = {x.sid: x for x in self._live}

    def _next_seq(self, node: str) -> int:
        self._seq[node] += 1
        return self._seq[node]

    def host_info(self, name: str, now: float) -> HostInfo:
        i = self._host_index[name]
        return HostInfo(
            name=name, api=f"http://127.0.0.1:{8000 + i}", slots=self.slots, busy=self._busy[name],
            queued=max(0, self._busy[name] - self.slots + 1) if self._busy[name] >= self.slots else 0,
            mem_used_bytes=(20 + 3 * i) * GiB, mem_total_bytes=64 * GiB,
            kv_cache_bytes=16 * GiB, kv_cache_used_bytes=(6 + i) * GiB, store_bytes=(40 + i) * GiB,
            kvshare_in_bps=1.2e9 * ((i + 1) % 3), kvshare_out_bps=0.8e9 * (i % 3),
            prefill_tps=6000.0, last_seen=now, block_size=BLOCK,
        )

    @property
    def partitioned(self) -> bool:
        """Whether each host's cluster view is its own part (a mesh past the directory threshold)."""
        return self.hosts > self.directory_after_hosts

    def _info(self, s: _Sess, now: float, *, home: bool = True, replica: bool = True) -> SessionInfo:
        rep = s.replica if replica else None
        return SessionInfo(
            session=s.sid, home=s.home if home else None, resident_tokens=s.tokens if home else 0,
            home_seq=s.turns + s.moves if home else 0, replica_host=rep,
            replica_tokens=s.replica_tokens if rep else 0,
            replica_behind_tokens=max(0, s.tokens - s.replica_tokens) if rep else 0,
            replica_age_s=(now - s.replica_at) if rep and s.replica_at else None,
            last_handoff=s.last, turns=s.turns, moves=s.moves, last_turn_at=s.last_turn_at + (now - self.t0),
            group=s.group,
        )

    def _parts(self, now: float) -> dict[str, list[SessionInfo]]:
        """What each host lists in a large mesh: all it knows of the sessions it is directory for (the whole
        picture), and its own holding of the others (home or replica)."""
        out: dict[str, list[SessionInfo]] = {h: [] for h in self.host_names}
        for s in self._sess:
            d = self.host_names[zlib.crc32(s.sid.encode()) % self.hosts]
            out[d].append(self._info(s, now))
            if s.home != d:
                out[s.home].append(self._info(s, now, replica=False))
            if s.replica is not None and s.replica not in (d, s.home):
                out[s.replica].append(self._info(s, now, home=False))
        return out

    def views(self, now: float) -> list[ClusterViewEvent]:
        """One cluster view per host, each its part (partitioned), or the one whole cluster view."""
        if not self.partitioned:
            return [self.view(now)]
        parts = self._parts(now)
        return [self.view(now, h, parts[h]) for h in self.host_names]

    def view(self, now: float | None = None, node: str | None = None,
                 sessions: list[SessionInfo] | None = None) -> ClusterViewEvent:
        now = self.t0 if now is None else now
        node = node or self.host_names[0]
        hosts = [self.host_info(h, now) for h in self.host_names]
        if sessions is None:
            sessions = self._parts(now)[node] if self.partitioned else [self._info(s, now) for s in self._sess]
        names = self.host_names
        links = [
            LinkInfo(src=a, dst=names[(i + 1) % self.hosts], bytes_sent=40 * GiB, transfers=310, last_transfer_s=0.42,
                     last_transfer_bytes=180 * (1 << 20), goodput_gbps=3.6, throughput_bps=2.4e9,
                     warm=300, partial=2, cold=0)
            for i, a in enumerate(names) if self.hosts > 1
        ]
        cluster = ClusterView(node=node, ts=now, hosts=hosts, sessions=sessions, links=links,
                                  counters=self.counters.model_copy(), scope="partial" if self.partitioned else "mesh")
        return ClusterViewEvent(ts=now, node=node, seq=self._seq[node], cluster=cluster)

    def events(self, now: float, n: int) -> list[Event]:
        """The next `n` events of a busy mesh: turns, handoffs, replica pushes, host status."""
        out: list[Event] = []
        rng = self._rng
        while self._live and len(out) < n:
            r = rng.random()
            s = self._live[rng.randrange(len(self._live))]
            if r < 0.06:
                h = rng.choice(self.host_names)
                out.append(HostStatus(ts=now, node=h, seq=self._next_seq(h), host=self.host_info(h, now)))
            elif r < 0.74:
                out.append(self._turn(s, now, started=r < 0.40))
            elif r < 0.82:
                out.append(self._handoff(s, now))
            elif r < 0.88 and s.sid not in self._inflight:
                out.append(self._push_started(s, now))
            elif self._inflight:
                out.extend(self._push_done(now))
        return out

    def _next_host(self, s: _Sess) -> str:
        return self.host_names[(self._host_index[s.home] + 1) % self.hosts]

    def _turn(self, s: _Sess, now: float, *, started: bool) -> Event:
        if started:
            self._busy[s.home] = min(self.slots + 2, self._busy[s.home] + 1)
            return TurnStarted(ts=now, node=s.home, seq=self._next_seq(s.home), session=s.sid, host=s.home,
                               prompt_tokens=s.tokens, cached_tokens=max(0, s.tokens - 200))
        self._busy[s.home] = max(0, self._busy[s.home] - 1)
        s.tokens += self._rng.randint(100, 600)
        s.turns += 1
        s.last_turn_at = now
        return TurnFinished(ts=now, node=s.home, seq=self._next_seq(s.home), session=s.sid, host=s.home,
                            prompt_tokens=s.tokens - 300, cached_tokens=max(0, s.tokens - 500),
                            completion_tokens=300, ttft_s=0.08, total_s=2.1)

    def _handoff(self, s: _Sess, now: float) -> Event:
        dst = s.replica or self._next_host(s)
        tokens = max(1, s.tokens)
        reused = tokens if self._rng.random() < 0.985 else tokens // 2
        cls = classify(reused / tokens)
        setattr(self.counters, cls, getattr(self.counters, cls) + 1)
        ev = Handoff(ts=now, node=dst, seq=self._next_seq(dst), session=s.sid, src=s.home, dst=dst,
                     cls=cls, prompt_tokens=tokens, reused_tokens=reused)
        s.home, s.moves, s.last = dst, s.moves + 1, cls
        s.replica = None
        return ev

    def _push_started(self, s: _Sess, now: float) -> Event:
        dst = self._next_host(s)
        blocks = max(1, s.tokens // BLOCK)
        self._inflight[s.sid] = (dst, blocks)
        return ReplicaStarted(ts=now, node=s.home, seq=self._next_seq(s.home), session=s.sid, src=s.home, dst=dst,
                              blocks=blocks, tokens=blocks * BLOCK)

    def _push_done(self, now: float) -> list[Event]:
        """The oldest push in flight lands: sent (from its source), then ready (on its target)."""
        sid, (dst, blocks) = next(iter(self._inflight.items()))
        del self._inflight[sid]
        s = self._index[sid]
        src = s.home if s.home != dst else self.host_names[(self._host_index[dst] - 1) % self.hosts]
        tokens, nbytes = blocks * BLOCK, blocks * BLOCK * 4096
        s.replica, s.replica_tokens, s.replica_at = dst, tokens, now
        return [
            ReplicaSent(ts=now, node=src, seq=self._next_seq(src), session=sid, src=src, dst=dst, blocks=blocks,
                        bytes=nbytes, seconds=nbytes * 8 / 9e9, tokens=tokens),
            ReplicaReady(ts=now, node=dst, seq=self._next_seq(dst), session=sid, src=src, dst=dst, tokens=tokens,
                         bytes=nbytes, lag_s=0.04, imported=True),
        ]


def view_frames(mesh: SyntheticMesh, now: float, url: str = "synthetic://mesh") -> list[tuple[str, str]]:
    """(source, JSON frame) of each cluster view the mesh opens its streams with (see `run_synthetic`)."""
    return [(f"{url}/{view.node}" if mesh.partitioned else url, view.model_dump_json()) for view in mesh.views(now)]


async def run_synthetic(
    mesh: SyntheticMesh,
    feed_frame: Callable[[str, str], object],
    on_connected: Callable[[str], object],
    *,
    url: str = "synthetic://mesh",
    events_per_s: float = 200.0,
    clock: Callable[[], float],
    batch_interval: float = 0.05,
    frames: list[tuple[str, str]] | None = None,
) -> None:
    """Play the mesh into a sink as JSON frames: a cluster view, then events at a steady rate.

    A partitioned mesh plays one stream per host (`{url}/{host}`), each event on its emitter's stream.
    `frames`: the cluster views already made (`view_frames`), so a benchmark does not time their making."""
    def source(node: str) -> str:
        return f"{url}/{node}" if mesh.partitioned else url

    for src, frame in frames if frames is not None else view_frames(mesh, clock(), url):
        on_connected(src)
        feed_frame(src, frame)
        await asyncio.sleep(0)  # the streams connect one by one, as 256 websockets would
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent = 0
    while True:
        await asyncio.sleep(batch_interval)
        due = int((loop.time() - start) * events_per_s) - sent
        if due <= 0:
            continue
        for ev in mesh.events(clock(), due):
            feed_frame(source(ev.node), ev.model_dump_json())
        sent += due
