"""Helpers shared by the console tests: a frozen clock, a small deterministic mesh,
a fake event source for Pilot tests, and a fake admin client that records calls.

(A uniquely named module rather than conftest imports: other test folders have
their own conftest.py, and `console` itself is the package under test.)"""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from kvmesh.console.app import KvmeshConsole
from kvmesh.console.config import ConsoleConfig
from kvmesh.console.state import ConsoleState
from kvmesh.node.protocol import (
    ActionResult,
    ClusterView,
    ClusterViewEvent,
    Event,
    HandoffCounters,
    HostInfo,
    LinkInfo,
    SessionInfo,
)

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC; every test's "now" is near this
NODE1 = "http://127.0.0.1:8001"
NODE2 = "http://127.0.0.1:8002"
GiB = 1 << 30


class Clock:
    """A clock the tests move by hand."""

    def __init__(self, now: float = T0 + 10) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def host(name: str, i: int, **kw: Any) -> HostInfo:
    base: dict[str, Any] = dict(
        name=name, api=f"http://127.0.0.1:800{i}", slots=4, busy=i % 4, queued=0,
        mem_used_bytes=(10 + i) * GiB, mem_total_bytes=64 * GiB, kvshare_in_bps=1e9 * i, kvshare_out_bps=5e8,
        last_seen=T0,
    )
    base.update(kw)
    return HostInfo(**base)


def make_view(
    node: str = "node-1", seq: int = 0, ts: float = T0, n_sessions: int = 6, block_size: int = 0
) -> ClusterViewEvent:
    """Three hosts, a few sessions, two links: small enough to read in a snapshot SVG.

    block_size 0: the hosts do not report one (an older node)."""
    hosts = [host(f"node-{i}", i, block_size=block_size) for i in (1, 2, 3)]
    sessions = []
    for i in range(n_sessions):
        home = f"node-{i % 3 + 1}"
        replica = f"node-{(i + 1) % 3 + 1}" if i % 2 == 0 else None
        sessions.append(SessionInfo(
            session=f"s-{i:03d}", home=home, resident_tokens=10_000 + 1000 * i, replica_host=replica,
            replica_tokens=10_000 + 1000 * i - (256 if i == 2 else 0) if replica else 0,
            replica_behind_tokens=256 if i == 2 else 0, replica_age_s=4.0 + i if replica else None,
            last_handoff=[None, "warm", "partial", "cold", "warm", "warm"][i % 6], turns=3 + i, moves=i % 3,
            last_turn_at=ts - 5 - i,  # every one idle (a turn within the idle window)
        ))
    links = [
        LinkInfo(src="node-1", dst="node-2", bytes_sent=3 * GiB, transfers=12, last_transfer_s=0.31,
                 last_transfer_bytes=120 << 20, goodput_gbps=3.2, throughput_bps=8e8, warm=40, partial=1, cold=0),
        LinkInfo(src="node-2", dst="node-3", bytes_sent=1 * GiB, transfers=5, last_transfer_s=0.12,
                 last_transfer_bytes=40 << 20, goodput_gbps=2.7, throughput_bps=0.0, warm=10, partial=0, cold=1),
    ]
    cluster = ClusterView(node=node, ts=ts, hosts=hosts, sessions=sessions, links=links,
                              counters=HandoffCounters(warm=50, partial=1, cold=1))
    return ClusterViewEvent(ts=ts, node=node, seq=seq, cluster=cluster)


class FakeSource:
    """Stands in for a node's websocket: the test pushes events, the app's worker feeds them in as JSON."""

    def __init__(self, url: str = NODE1) -> None:
        self.url = url
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue()

    def push(self, *events: Event) -> None:
        for ev in events:
            self.queue.put_nowait(ev)

    async def run(self, state: ConsoleState) -> None:
        state.node_connected(self.url)
        while True:
            ev = await self.queue.get()
            if ev is None:
                state.node_disconnected(self.url, "closed by test")
                continue
            state.feed_frame(self.url, ev.model_dump_json())

    async def drained(self) -> None:
        while not self.queue.empty():
            await asyncio.sleep(0.01)


@dataclass
class FakeAdmin:
    """Records admin calls; answers ok (or with `result`)."""

    result: ActionResult = field(default_factory=lambda: ActionResult(ok=True, message="accepted"))
    calls: list[tuple[str, ...]] = field(default_factory=list)

    async def drain(self, host: str) -> ActionResult:
        self.calls.append(("drain", host))
        return self.result

    async def undrain(self, host: str) -> ActionResult:
        self.calls.append(("undrain", host))
        return self.result

    async def migrate(self, session: str, target: str) -> ActionResult:
        self.calls.append(("migrate", session, target))
        return self.result

    async def replicate(self, session: str) -> ActionResult:
        self.calls.append(("replicate", session))
        return self.result

    async def aclose(self) -> None:
        return None


def make_app(
    clock: Clock,
    *,
    readonly: bool = False,
    theme: str = "kvmesh-dark",
    ascii_only: bool = False,
    source: FakeSource | None = None,
    admin: FakeAdmin | None = None,
    snapshot: ClusterViewEvent | None = None,
    view: str = "main",
) -> tuple[KvmeshConsole, ConsoleState]:
    """An app over a pre-filled state (snapshot applied), optionally fed by a FakeSource."""
    st = ConsoleState(clock=clock)
    if snapshot is not None:
        st.node_connected(NODE1)
        st.feed(NODE1, snapshot)
    cfg = ConsoleConfig(readonly=readonly, theme=theme, ascii=ascii_only, utc=True, discover=False,
                        refresh_interval=0.1, view=view)  # type: ignore[arg-type]
    sources = [(source.url, source.run)] if source is not None else []
    app = KvmeshConsole(cfg, state=st, sources=sources, admin=admin)  # type: ignore[arg-type]
    return app, st


def screen_text(app: KvmeshConsole) -> str:
    """What the terminal would show now, as plain text (all screens in the stack composited)."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, color_system="truecolor",
                      record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


GROUP = "cc-1"  # a client session (an affinity group) in the tests' threads
THREADS = ("a1b2c3d4", "0f0e0d0c", "12345678")  # its threads' keys past the group: `cc-1#a1b2c3d4`...


def add_group(snap: ClusterViewEvent, group: str = GROUP, threads: tuple[str, ...] = THREADS) -> ClusterViewEvent:
    """`snap` with a client session's conversations added: its main (keyed `group`, more tokens than any other
    session) and a thread per hex (`<group>#<hex>`, on the hosts in turn), all idle, each naming `group`."""
    ts = snap.cluster.ts
    infos = [SessionInfo(session=group, group=group, home="node-2", resident_tokens=42_000, turns=9,
                         last_turn_at=ts - 2)]
    for i, h in enumerate(threads):
        infos.append(SessionInfo(session=f"{group}#{h}", group=group, home=f"node-{i % 3 + 1}",
                                 resident_tokens=5000 + 700 * i, turns=2 + i, last_turn_at=ts - 3 - i))
    cluster = snap.cluster.model_copy(update={"sessions": [*snap.cluster.sessions, *infos]})
    return snap.model_copy(update={"cluster": cluster})
