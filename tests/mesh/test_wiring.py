"""The node's parts are wired narrowly: none of them imports the Node; the mesh and the turn path are
built from an engine, a config section, a publish function and small interfaces (here: fakes), and a
turn that ends on a host decides there where its replica goes. In-process; no servers."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

import kvmesh.node
from kvmesh.node.config import EngineConfig, MeshConfig, PeerConfig, SimConfig
from kvmesh.node.engine.engine import Engine, GenerateRequest, TurnDone
from kvmesh.node.kvshare.explain import ReuseExplained
from kvmesh.node.mesh.actions import RelayFailed, relay_action
from kvmesh.node.mesh.mesh import Mesh
from kvmesh.node.mesh.threads import Threads
from kvmesh.node.mesh.turn import Placed, TurnPath
from kvmesh.node.protocol import (
    ActionResult,
    Event,
    HostInfo,
    LinkInfo,
    PeerStatus,
    SessionHolding,
    TurnFinished,
    TurnStarted,
)

NODE_DIR = Path(kvmesh.node.__file__).resolve().parent


def _imported_modules(source: str) -> set[str]:
    """Every module a file imports, at the top, under TYPE_CHECKING or inside a function."""
    out: set[str] = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module:
            out.add(n.module)
            out.update(f"{n.module}.{a.name}" for a in n.names)
    return out


def test_parts_never_import_the_node() -> None:
    """kv_share, the mesh, the turn path, metrics and the event hub never import kvmesh.node.node (no cycle)."""
    files = [*NODE_DIR.glob("mesh/*.py"), *NODE_DIR.glob("kvshare/*.py"), NODE_DIR / "metrics.py", NODE_DIR / "events.py"]
    assert len(files) > 6
    offenders = [f.relative_to(NODE_DIR).as_posix() for f in files
                 if "kvmesh.node.node" in _imported_modules(f.read_text())]
    assert offenders == []


class FakeReplicas:
    """kv_share as the mesh and a turn see it (ReplicaView + TurnReplicas), recording what they ask."""

    wasted_bytes = 0

    def __init__(self) -> None:
        self.imported: list[str] = []
        self.after: list[tuple[str, str | None]] = []
        self.rehomed_sessions: list[str] = []

    def store_tokens(self, session: str) -> tuple[int, float | None]:
        return 0, None

    def store_sessions(self) -> list[str]:
        return []

    def inbound(self, session: str) -> tuple[int, float | None, int]:
        return 0, None, 0

    def inbound_sessions(self) -> list[str]:
        return []

    def rehomed(self, session: str) -> None:
        self.rehomed_sessions.append(session)

    def inflight_to(self, session: str) -> str | None:
        return None

    def import_bps(self) -> float:
        return 1e9

    def links_out(self) -> list[LinkInfo]:
        return []

    async def ensure_imported(self, session: str, prompt: np.ndarray) -> int:
        self.imported.append(session)
        return 0

    def explain(self, session: str, prompt: np.ndarray, reused: int, predicted: int | None) -> ReuseExplained:
        return ReuseExplained()

    def worth_replicating(self, session: str) -> bool:
        return True

    def after_turn(self, session: str, target: str | None, turn_s: float = 0.0) -> None:
        self.after.append((session, target))


@pytest.fixture
def engine() -> Iterator[Engine]:
    sim = SimConfig(kv_scale=1 / 1280, prefill_tps=1e7, decode_tps=1e6)
    e = Engine(EngineConfig(kind="sim", cache_bytes=1 << 20, block_size=16, slots=1, sim=sim))
    try:
        yield e
    finally:
        e.close()


def _mesh(engine: Engine, replicas: FakeReplicas, events: list[Event]) -> Mesh:
    """Host "a" with one peer "b" that has reported itself idle (as a status poll would)."""
    cfg = MeshConfig(peers=[PeerConfig(name="b", api="http://b.invalid:8000", kvshare="b.invalid:9000")])
    mesh = Mesh("a", cfg, engine, replicas, publish=events.append, host_info=lambda: HostInfo(name="a"),
                on_decision=lambda s: None)
    mesh.peers.update(mesh.peers.peers["b"], PeerStatus(host=HostInfo(name="b", slots=2, prefill_tps=1e6)))
    return mesh


def test_a_turn_decides_its_replica_target_where_it_ends(engine: Engine) -> None:
    """A turn run here imports first, publishes its start and end, and hands kv_share placement's next host."""
    replicas, events = FakeReplicas(), list[Event]()
    mesh = _mesh(engine, replicas, events)
    path = TurnPath("a", engine, mesh, replicas, Threads(), publish=events.append, forward_timeout_s=5.0,
                    on_resumed=lambda: None)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hello " * 40}])

    async def turn() -> None:
        run = await path.run_here(GenerateRequest(session="s1", prompt=prompt, max_tokens=4), Placed(), 1)
        ends = [ev async for ev in run.stream() if isinstance(ev, TurnDone)]
        assert len(ends) == 1

    asyncio.run(turn())
    assert replicas.imported == ["s1"]
    assert replicas.after == [("s1", "b")], "the replica goes where placement would send the session next"
    assert [type(e) for e in events if isinstance(e, TurnStarted | TurnFinished)] == [TurnStarted, TurnFinished]
    assert mesh.home("s1") == "a" and mesh.routed["s1"] == ("a", 1)


def test_a_turn_ending_while_the_next_host_has_a_queue_pushes_nothing_and_says_so(engine: Engine) -> None:
    """The host the session would move to has turns queued: kv_share is handed no target, and the mesh counts
    the push held back (the node's kvmesh_replica_pushes_held_back)."""
    replicas, events, held_back = FakeReplicas(), list[Event](), list[None]()
    cfg = MeshConfig(peers=[PeerConfig(name="b", api="http://b.invalid:8000", kvshare="b.invalid:9000")])
    mesh = Mesh("a", cfg, engine, replicas, publish=events.append, host_info=lambda: HostInfo(name="a"),
                on_decision=lambda s: None, on_push_held_back=lambda: held_back.append(None))
    mesh.peers.update(mesh.peers.peers["b"], PeerStatus(host=HostInfo(name="b", slots=2, busy=2, queued=3,
                                                                      prefill_tps=1e6)))
    path = TurnPath("a", engine, mesh, replicas, Threads(), publish=events.append, forward_timeout_s=5.0,
                    on_resumed=lambda: None)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hello " * 40}])

    async def turn() -> None:
        run = await path.run_here(GenerateRequest(session="s1", prompt=prompt, max_tokens=4), Placed(), 1)
        assert len([ev async for ev in run.stream() if isinstance(ev, TurnDone)]) == 1

    asyncio.run(turn())
    assert replicas.after == [("s1", None)] and len(held_back) == 1


def test_relay_action_reads_the_answer_or_says_why_not(engine: Engine) -> None:
    """The one peer relay: an ActionResult on 200, RelayFailed with the status on an error, without one for an unknown host."""
    mesh = _mesh(engine, FakeReplicas(), [])
    answers = {"/ok": httpx.Response(200, json={"ok": True, "message": "done"}),
               "/no": httpx.Response(409, json={"error": {"message": "no"}})}
    mesh.peers._client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: answers[r.url.path]))

    async def calls() -> None:
        assert await relay_action(mesh, "b", "/ok", timeout_s=1.0) == ActionResult(ok=True, message="done")
        with pytest.raises(RelayFailed) as refused:
            await relay_action(mesh, "b", "/no", timeout_s=1.0)
        assert refused.value.status == 409
        with pytest.raises(RelayFailed) as unknown:
            await relay_action(mesh, "nosuch", "/ok", timeout_s=1.0)
        assert unknown.value.status is None
        await mesh.peers.client.aclose()

    asyncio.run(calls())


def test_a_session_homed_on_a_peer_since_makes_this_hosts_copy_a_replica(engine: Engine) -> None:
    """A peer reporting a session homed there after its last turn here demotes the store's copy, once; an older
    report, or a session this host never homed, does nothing."""
    replicas, events = FakeReplicas(), list[Event]()
    mesh = _mesh(engine, replicas, events)
    mesh.book.turn_served("s", 100, None, 3)
    b = mesh.peers.peers["b"]
    status = PeerStatus(host=HostInfo(name="b", slots=2, prefill_tps=1e6))

    def report(seq: int, session: str = "s") -> None:
        mesh.peers.update(b, status.model_copy(update={"sessions": [SessionHolding(session=session, home_seq=seq)]}))

    report(2)
    report(4, "other")
    assert replicas.rehomed_sessions == []
    report(4)
    report(5)
    assert replicas.rehomed_sessions == ["s"]
    mesh.book.turn_served("s", 100, None, 6)  # it came back: homed here again
    report(7)
    assert replicas.rehomed_sessions == ["s", "s"]
