"""Real-terminal check: the console in tmux against a fake node's websocket, driven with send-keys."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fake_node import FakeEventsServer
from kvm_helpers import T0, make_view

from kvmesh.node.protocol import Handoff

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")


class Tmux:
    """One private tmux server (its own -L socket), so nothing else's sessions are touched."""

    def __init__(self) -> None:
        self.socket = f"kvmesh-console-test-{uuid.uuid4().hex[:8]}"
        self.socket_path: str | None = None

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=check,
                              timeout=20)

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "console").stdout

    def wait_for(self, cond: Callable[[str], bool], timeout: float = 20.0) -> str:
        end = time.monotonic() + timeout
        text = ""
        while time.monotonic() < end:
            text = self.screen()
            if cond(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"screen never matched; last screen:\n{text}")

    def alive(self) -> bool:
        return self.run("has-session", "-t", "console", check=False).returncode == 0

    def kill(self) -> None:
        self.run("kill-server", check=False)
        if self.socket_path:  # kill-server leaves the socket file behind
            Path(self.socket_path).unlink(missing_ok=True)


@pytest.fixture
def node() -> Iterator[FakeEventsServer]:
    # Stamped now: the console runs on the real clock, and sessions with no turn for minutes have ended.
    srv = FakeEventsServer(lambda: make_view(ts=time.time()))
    srv.start()
    yield srv
    srv.stop()


def test_console_in_tmux_shows_hosts_counters_and_answers_keys(node: FakeEventsServer) -> None:
    """In a real 80x24 terminal: hosts and counters appear, p pauses with N pending, 2 shows links, q quits."""
    tmux = Tmux()
    url = f"http://127.0.0.1:{node.port}"
    cmd = f"{sys.executable} -m kvmesh.console --node {url} --readonly --utc --no-discover"
    try:
        tmux.run("new-session", "-d", "-s", "console", "-x", "80", "-y", "24", "-c", str(REPO), cmd)
        tmux.socket_path = tmux.run("display-message", "-p", "#{socket_path}").stdout.strip() or None
        screen = tmux.wait_for(lambda s: "node-3" in s and "WARM 50" in s)
        for text in ("node-1", "node-2", "RO", "nodes 1/1", "PART 1", "COLD 1", "s-000"):
            assert text in screen, text
        tmux.run("send-keys", "-t", "console", "p")
        tmux.wait_for(lambda s: "PAUSED" in s)
        node.publish(Handoff(ts=T0 + 5, node="node-2", seq=1, session="s-001", src="node-1", dst="node-2",
                             cls="cold", prompt_tokens=100, reused_tokens=0))
        tmux.wait_for(lambda s: "1 update pending" in s)
        assert "COLD 1" in tmux.screen()
        tmux.run("send-keys", "-t", "console", "p")
        tmux.wait_for(lambda s: "COLD 2" in s and "PAUSED" not in s)
        tmux.run("send-keys", "-t", "console", "2")
        tmux.wait_for(lambda s: "Throughput" in s and "node-2→node-3" in s)
        tmux.run("send-keys", "-t", "console", "q")
        end = time.monotonic() + 10
        while tmux.alive() and time.monotonic() < end:
            time.sleep(0.2)
        assert not tmux.alive(), "q quits the console (its tmux session ends)"
    finally:
        tmux.kill()


def test_kvmesh_demo_opens_the_demo_view_in_tmux() -> None:
    """`kvmesh demo --view demo` at 80x24: the read-only demo view with live counters and a link; v flips to the
    operator view and back; q quits and the demo stops."""
    tmux = Tmux()
    cmd = f"{sys.executable} -m kvmesh demo --view demo --sessions 8"
    try:
        tmux.run("new-session", "-d", "-s", "console", "-x", "80", "-y", "24", "-c", str(REPO), cmd)
        tmux.socket_path = tmux.run("display-message", "-p", "#{socket_path}").stdout.strip() or None
        screen = tmux.wait_for(lambda s: "WARM % of" in s and "Handoffs as they happen" in s, timeout=90)
        assert " RO " in screen and "nodes 2/2" in screen
        # Replicas cross the link within a few turns; its row (and a sparkline) appears in the demo view.
        tmux.wait_for(lambda s: "gpu-1→gpu-2" in s or "gpu-2→gpu-1" in s, timeout=120)
        tmux.run("send-keys", "-t", "console", "v")
        tmux.wait_for(lambda s: "Sessions" in s and " live " in s and "Host" in s)
        tmux.run("send-keys", "-t", "console", "v")
        tmux.wait_for(lambda s: "WARM % of" in s)
        tmux.run("send-keys", "-t", "console", "q")
        end = time.monotonic() + 60
        while tmux.alive() and time.monotonic() < end:
            time.sleep(0.5)
        assert not tmux.alive(), "q quits the console and the demo stops"
    finally:
        tmux.kill()
