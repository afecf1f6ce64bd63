"""The console sees the whole mesh past `directory_after_hosts`: on real nodes whose snapshots each hold only
part of the sessions, its headless state holds every session some node holds, through node and console restarts;
and any node's `/v1/cluster` says it is partial, while `?scope=mesh` fans in to the whole.

Four sim nodes with `directory_after_hosts = 2`: each node's snapshot lists the sessions it holds and those it
is directory for, so no single snapshot is the mesh (issue 32: the console kept the last one it took).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.console.ingest import Backoff, stream_node
from kvmesh.console.state import ConsoleState
from kvmesh.node.lab.launcher import LocalMesh, write_mesh
from kvmesh.node.mesh.auth import PEER_HEADER, peer_token

pytestmark = pytest.mark.anyio
NAMES = ["h0", "h1", "h2", "h3"]
SECRET = "msk-" + secrets.token_hex(16)
WAIT_S = 20.0  # a deadline for the mesh to settle, never a speed goal


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    m = write_mesh(tmp_path, NAMES,
                   engine={"kind": "sim", "slots": 2, "cache_bytes": 16 << 20,
                           "sim": {"kv_scale": 0.02, "decode_tps": 400.0, "prefill_tps": 40000.0}},
                   extra={"mesh": {"secret": SECRET, "directory_after_hosts": 2, "stale_after_s": 1.5},
                          "kvshare": {"fsync": "never", "replicate_min_tokens": 512}})
    m.start()
    try:
        yield m
    finally:
        m.stop()


async def _turn(http: httpx.AsyncClient, api: str, session: str, n: int) -> None:
    body = {"model": "kvmesh-sim", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": f"agent {session} " * 200},
                         *({"role": "user", "content": f"step {i} of {session}"} for i in range(n + 1))]}
    r = await http.post(f"{api}/v1/chat/completions", json=body, headers={"X-Session-Id": session})
    r.raise_for_status()


async def _held(http: httpx.AsyncClient, m: LocalMesh, down: frozenset[str] = frozenset()) -> set[str]:
    """Every session some running node holds (engine, book, store or inbound), from its own peer status."""
    out: set[str] = set()
    for n in m.names:
        if n in down:
            continue
        r = await http.get(m.api(n) + "/v1/peer/status", headers={PEER_HEADER: peer_token(SECRET.encode())})
        r.raise_for_status()
        out |= {s["session"] for s in r.json()["sessions"]}
    return out


class Console:
    """A headless console: one ingest loop per node into a `ConsoleState`, as the app runs them."""

    def __init__(self, apis: list[str]) -> None:
        self.state = ConsoleState()
        self.tasks = [asyncio.create_task(stream_node(a, self.state, backoff=Backoff(0.1, 0.5))) for a in apis]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0) as c:
        yield c


async def _until(pred: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        v = await pred() if callable(pred) else pred  # type: ignore[operator]
        if v is True:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {v}")
        await asyncio.sleep(0.2)


async def test_console_holds_every_session_the_mesh_holds_through_restarts(mesh: LocalMesh, http) -> None:  # type: ignore[no-untyped-def]
    """Past the directory threshold the console's sessions are the union of what the nodes hold: after turns
    through every entry, while a node is down (the others' sessions stay), after it restarts, and after the
    console itself restarts."""
    apis = [mesh.api(n) for n in NAMES]
    sessions = [f"agent-{i}" for i in range(16)]
    for i, s in enumerate(sessions):
        await _turn(http, apis[i % 4], s, 0)
        await _turn(http, apis[(i + 1) % 4], s, 1)
    console = Console(apis)

    async def same(down: frozenset[str] = frozenset()) -> bool | str:
        held = await _held(http, mesh, down)
        got = set(console.state.sessions)
        return True if got == held else f"missing {sorted(held - got)}, extra {sorted(got - held)}"

    try:
        await _until(same, "the console's sessions are the nodes' union")
        # Some snapshot is only part of it (else this test proves nothing).
        parts = [{s["session"] for s in (await http.get(a + "/v1/cluster")).json()["sessions"]} for a in apis]
        assert any(p < set(sessions) for p in parts), [len(p) for p in parts]
        own = (await http.get(apis[0] + "/v1/cluster")).json()
        assert own["scope"] == "partial" and "/v1/cluster?scope=mesh" in own["note"], own["note"]

        async def fan_in() -> bool | str:
            whole = (await http.get(apis[0] + "/v1/cluster", params={"scope": "mesh"})).json()
            got, held = {s["session"] for s in whole["sessions"]}, await _held(http, mesh)
            return True if (whole["scope"], got) == ("mesh", held) else f"{whole['scope']}: missing {held - got}"

        await _until(fan_in, "GET /v1/cluster?scope=mesh lists every session the nodes hold")

        node = mesh.nodes["h1"]
        node.stop()
        others = await _held(http, mesh, frozenset({"h1"}))

        async def kept() -> bool | str:
            return True if others <= set(console.state.sessions) else f"lost {sorted(others - set(console.state.sessions))}"

        await _until(kept, "with h1 down the console keeps every other node's sessions")
        node.start().wait_ready()
        for i, s in enumerate(sessions[:6]):
            await _turn(http, apis[(i + 2) % 4], s, 2)
        await _until(same, "after h1 restarts the console's sessions are the nodes' union")

        await console.stop()
        console = Console(apis)
        await _until(same, "a restarted console rebuilds the union")
    finally:
        await console.stop()
