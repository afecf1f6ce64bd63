"""End to end: the console on two real node processes drains a host, and the node reports it draining."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.console.admin import AdminClient
from kvmesh.console.app import KvmeshConsole
from kvmesh.console.config import ConsoleConfig
from kvmesh.console.screens.confirm import ConfirmScreen
from kvmesh.console.state import ConsoleState
from kvmesh.node.lab.launcher import NodeProcess, write_mesh

pytestmark = pytest.mark.anyio
TOKEN = "console-e2e-admin-token"


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[list[NodeProcess]]:
    mesh = write_mesh(tmp_path, ["node-a", "node-b"],
                      engine={"kind": "sim", "slots": 2, "cache_bytes": 16 << 20, "sim": {"kv_scale": 0.02}},
                      extra={"admin_token": TOKEN, "mesh": {"poll_interval_s": 0.2}, "kvshare": {"fsync": "never"}})
    mesh.start()
    try:
        yield list(mesh.nodes.values())
    finally:
        mesh.stop()


async def test_console_drains_a_real_node(two_nodes: list[NodeProcess]) -> None:
    """Drain node-b from the console (d, confirm): node-b itself then reports draining, and the log says so."""
    apis = [n.api for n in two_nodes]
    state = ConsoleState()
    app = KvmeshConsole(ConsoleConfig(nodes=apis, refresh_interval=0.2), state=state)
    app.admin = AdminClient(lambda: apis, TOKEN)
    async with app.run_test(size=(120, 40)) as pilot:
        deadline = time.monotonic() + 30
        while set(state.hosts) != {"node-a", "node-b"}:
            assert time.monotonic() < deadline, f"the console never saw both hosts: {list(state.hosts)}"
            await pilot.pause(0.2)
        await pilot.pause(0.5)
        await pilot.press("h", "down", "d")
        await pilot.pause(0.3)
        assert isinstance(app.screen, ConfirmScreen)
        assert app.screen.action_spec.targets == ("node-b",)
        await pilot.press("right", "enter")
        async with httpx.AsyncClient(timeout=5) as c:
            deadline = time.monotonic() + 20
            while True:
                hosts = (await c.get(f"{apis[1]}/v1/cluster")).json()["hosts"]
                if next(h for h in hosts if h["name"] == "node-b")["draining"]:
                    break
                assert time.monotonic() < deadline, "node-b never reported draining"
                await pilot.pause(0.2)
            health = (await c.get(f"{apis[1]}/health")).json()
        assert health["status"] == "draining"
        deadline = time.monotonic() + 10
        while not any("drain" in e.text.lower() and "node-b" in e.text for e in state.log):
            assert time.monotonic() < deadline, "the drain never showed in the console's event log"
            await pilot.pause(0.2)
