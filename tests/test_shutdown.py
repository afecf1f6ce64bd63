"""WarmStop, the signal handler's logic: one drain, exit when nothing is pending or at the deadline; a second signal exits now."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from types import SimpleNamespace

from kvmesh.node.shutdown import WarmStop


class FakeNode:
    def __init__(self, pending_for: int) -> None:
        self.name, self.stopping, self.drains, self.left = "n", False, 0, pending_for

    async def begin_drain(self) -> None:
        self.drains += 1

    def drain_pending(self) -> str | None:
        self.left -= 1
        return "1 running turn" if self.left > 0 else None


def _server() -> SimpleNamespace:
    return SimpleNamespace(should_exit=False, force_exit=False, config=SimpleNamespace(timeout_graceful_shutdown=None))


def test_exits_once_nothing_is_pending() -> None:
    """The first signal marks the node stopping, drains once, and sets should_exit when the node has nothing pending."""
    async def main() -> tuple[FakeNode, SimpleNamespace]:
        node, server = FakeNode(pending_for=3), _server()
        stop = WarmStop(node, server, timeout_s=10, poll_s=0.001)
        stop.on_signal()
        assert node.stopping and not server.should_exit
        assert stop.task is not None
        await stop.task
        return node, server
    node, server = asyncio.run(main())
    assert node.drains == 1 and server.should_exit and not server.force_exit and node.left <= 0
    assert 1 <= server.config.timeout_graceful_shutdown <= 10


def test_the_deadline_ends_a_drain_that_never_finishes() -> None:
    """A drain still pending at drain_timeout_s exits anyway (should_exit, not force)."""
    async def main() -> SimpleNamespace:
        server = _server()
        stop = WarmStop(FakeNode(pending_for=10**9), server, timeout_s=0.05, poll_s=0.005)
        stop.on_signal()
        assert stop.task is not None
        await asyncio.wait_for(stop.task, 5)
        return server
    server = asyncio.run(main())
    assert server.should_exit and not server.force_exit


def test_a_second_signal_forces_the_exit() -> None:
    """A second signal during the drain sets force_exit at once."""
    async def main() -> SimpleNamespace:
        server = _server()
        stop = WarmStop(FakeNode(pending_for=10**9), server, timeout_s=60, poll_s=0.005)
        stop.on_signal()
        await asyncio.sleep(0.02)
        stop.on_signal()
        assert server.force_exit and server.should_exit
        assert stop.task is not None
        stop.task.cancel()
        return server
    asyncio.run(main())


def test_a_node_whose_exit_hangs_is_ended_with_its_stacks_in_the_log(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """After the drain tells the server to stop, a process still up past the rest of the deadline plus exit_grace_s
    writes every thread's stack to stderr and exits 1 (here the main thread blocks, as a stuck stop step would)."""
    script = tmp_path / "hang.py"
    script.write_text(
        "import asyncio, time\n"
        "from types import SimpleNamespace\n"
        "from kvmesh.node.shutdown import WarmStop, exit_watchdog\n"
        "class N:\n"
        "    name, stopping = 'n', False\n"
        "    async def begin_drain(self): pass\n"
        "    def drain_pending(self): return None\n"
        "async def main():\n"
        "    s = WarmStop(N(), SimpleNamespace(should_exit=False, force_exit=False), timeout_s=0.1, poll_s=0.01,\n"
        "                 exit_grace_s=0.5, watchdog=exit_watchdog)\n"
        "    s.on_signal()\n"
        "    await s.task\n"
        "asyncio.run(main())\n"
        "def stuck_in_a_stop_step(): time.sleep(60)\n"
        "stuck_in_a_stop_step()\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50)
    assert time.monotonic() - t0 < 30
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "stuck_in_a_stop_step" in r.stderr and "Timeout" in r.stderr


def test_a_node_whose_exit_waits_on_an_await_logs_where() -> None:
    """While the exit waits on a coroutine (a stop step awaiting what never comes), every task's await chain is logged."""
    script = (
        "import asyncio, logging\n"
        "from types import SimpleNamespace\n"
        "from kvmesh.node.shutdown import WarmStop, exit_watchdog\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "class N:\n"
        "    name, stopping = 'n', False\n"
        "    async def begin_drain(self): pass\n"
        "    def drain_pending(self): return None\n"
        "async def stuck_on_an_await(): await asyncio.sleep(60)\n"
        "async def main():\n"
        "    s = WarmStop(N(), SimpleNamespace(should_exit=False, force_exit=False), timeout_s=0.1, poll_s=0.01,\n"
        "                 exit_grace_s=1.0, watchdog=exit_watchdog, report_every_s=0.2)\n"
        "    s.on_signal()\n"
        "    await s.task\n"
        "    await asyncio.create_task(stuck_on_an_await(), name='the-stop-step')\n"
        "asyncio.run(main())\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "the exit still waits; 0 connections open: none" in r.stderr, r.stderr
    assert "task the-stop-step at" in r.stderr and "stuck_on_an_await" in r.stderr, r.stderr
